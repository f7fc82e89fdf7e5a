"""Training: optax setup, mesh + sharding rules, orbax checkpoints, metrics, the trainer."""


def train_and_evaluate(config, workdir: str):
    """Train `config` in `workdir` (resuming if it holds checkpoints); return the final eval metrics."""
    from nlearn.train.trainer import train_and_evaluate as run

    return run(config, workdir)
