"""Training end to end: golden loss, kill-and-resume, corrupt checkpoints, sharded == single."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer as transformer_config
from run_helpers import ROOT, kill_after_checkpoint_and_resume, load_family_config, run_cli, tiny_overrides
from nlearn.train.state import make_setup
from nlearn.train.step import make_train_step


def golden_config():
    config = transformer_config.get_config("tiny")
    with config.unlocked():
        config.data.vocab_size = 97
        config.model.update(d_model=32, num_layers=2, num_heads=2)
        config.train.update(batch_size=2, seq_len=8, warmup_steps=0, lr=1e-2)
    return config


def test_one_step_golden_loss():
    """Pinned losses of a seeded model before and after one AdamW step (catches silent changes
    to initialisation, the model, the loss or the optimizer)."""
    setup = make_setup(golden_config())
    state = setup.init_state()
    step = jax.jit(make_train_step(setup.config, setup.graphdef, setup.optimizer, dtype=jnp.float32))
    tokens = (np.arange(2 * 9, dtype=np.int32).reshape(2, 9) * 7) % 97
    batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
    state, first = step(state, batch)
    _, second = step(state, batch)
    np.testing.assert_allclose(float(first["loss"]), GOLDEN[0], rtol=1e-5)
    np.testing.assert_allclose(float(second["loss"]), GOLDEN[1], rtol=1e-5)


GOLDEN = (4.539079666137695, 4.001621246337891)  # jax 0.10.2, flax 0.12.8, CPU


def test_grad_accumulation_matches_full_batch():
    """Micro-batches give the whole batch's weighted-mean loss and its gradient (compared before any optimizer
    normalises it), also when the halves carry different numbers of weighted tokens."""
    import optax

    from nlearn.train.step import token_losses

    config = golden_config()
    setup = make_setup(config)
    params = setup.init_state()["params"]
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 97, (4, 9)).astype(np.int32)
    weights = (rng.random((4, 8)) < np.array([[0.9], [0.9], [0.3], [0.3]])).astype(np.float32)
    batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
             "weights": jnp.asarray(weights)}

    def mean_loss(p):
        losses = token_losses(setup.graphdef, p, batch["inputs"], batch["targets"], jnp.float32)
        return jnp.sum(losses * weights) / weights.sum()

    want_loss, want = jax.jit(jax.value_and_grad(mean_loss))(params)  # jitted: one compile, not one per op
    # An optax transformation that keeps the gradient it is given as its state (and moves nothing).
    keep = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                        lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))
    for accum in (1, 2):
        with config.unlocked():
            config.train.grad_accum = accum
        state = {"params": params, "opt_state": keep.init(params), "step": jnp.zeros((), jnp.int32),
                 "rng": jax.random.key_data(jax.random.key(0))}
        state, metrics = jax.jit(make_train_step(config, setup.graphdef, keep))(state, batch)
        np.testing.assert_allclose(float(metrics["loss"]), float(want_loss), rtol=1e-6)
        for got, ref in zip(jax.tree.leaves(state["opt_state"]), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-4, atol=1e-7)


def _train_cmd(workdir, cache_dir, text_corpus, config="configs/transformer.py:tiny", **extra):
    return [sys.executable, "-m", "nlearn.cli.train", f"--config={config}",
            f"--workdir={workdir}", *tiny_overrides(cache_dir, text_corpus, **extra)]


def _final(proc):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    workdir = [a for a in proc.args if a.startswith("--workdir=")][0].split("=", 1)[1]
    return json.load(open(os.path.join(workdir, "eval.json")))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, cache_dir, text_corpus):
    """An uninterrupted 12-step run on one device."""
    workdir = tmp_path_factory.mktemp("reference")
    cmd = _train_cmd(workdir, cache_dir, text_corpus, **{"train.steps": 12})
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    return workdir, _final(proc), proc


def test_run_writes_metrics_config_and_checkpoints(reference_run):
    workdir, result, proc = reference_run
    assert result["step"] == 12 and np.isfinite(result["loss"])
    assert "perplexity" in proc.stdout and "tok/s" in proc.stdout and "ETA" in proc.stdout
    records = [json.loads(l) for l in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in records if "loss" in r] == [2, 4, 6, 8, 10, 12]
    assert json.load(open(workdir / "config.json"))["train"]["steps"] == 12
    assert max(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit()) == 12


def _kill_after_step_6_and_resume(workdir, cmd) -> dict:
    """Run `cmd`, SIGKILL it right after its step-6 checkpoint, rerun it; the resumed run's eval.json."""
    return _final(kill_after_checkpoint_and_resume(workdir, cmd, 6))


def test_sigkill_then_restart_resumes_exactly(tmp_path, cache_dir, text_corpus, reference_run):
    """Kill -9 right after a mid-run checkpoint; the same command resumes and ends identically."""
    result = _kill_after_step_6_and_resume(tmp_path, _train_cmd(tmp_path, cache_dir, text_corpus,
                                                                **{"train.steps": 12}))
    assert result["step"] == 12
    assert abs(result["loss"] - reference_run[1]["loss"]) <= 1e-6


@pytest.mark.slow  # Hope's two-pass step compiles for minutes on 2 cores
def test_hope_resumes_exactly_after_sigkill_and_generates(tmp_path, cache_dir, text_corpus):
    """`configs/hope.py` with the CMS learning in context (both levels update inside the 32-token
    window): killed and resumed == uninterrupted, then `nlearn-generate` continues a prompt."""
    extra = {"train.steps": 12, "model.cms.periods": "(8,16)", "model.cms.lr": "(0.01,0.01)"}
    runs = {}
    for name in ("reference", "killed"):
        (tmp_path / name).mkdir()
        runs[name] = _train_cmd(tmp_path / name, cache_dir, text_corpus, "configs/hope.py:tiny", **extra)
    reference = _final(subprocess.run(runs["reference"], cwd=ROOT, capture_output=True, text=True, timeout=900))
    result = _kill_after_step_6_and_resume(tmp_path / "killed", runs["killed"])
    assert result["step"] == 12 and np.isfinite(result["loss"])
    assert abs(result["loss"] - reference["loss"]) <= 1e-6
    proc = run_cli("generate", f"--workdir={tmp_path / 'killed'}", "--prompt=It is a truth", "--max_new_tokens=8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("It is a truth")


def test_corrupt_newest_checkpoint_falls_back(tmp_path, reference_run):
    """Garbage in the newest checkpoint: eval warns and uses the previous one, never step 0."""
    workdir = tmp_path / "run"
    shutil.copytree(reference_run[0], workdir)
    for root, _, files in os.walk(workdir / "checkpoints" / "12" / "state"):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"\x00garbage")
    proc = run_cli("eval", f"--workdir={workdir}")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["step"] == 9
    assert "unreadable" in proc.stderr


def test_eval_and_generate_from_checkpoint(reference_run):
    workdir = reference_run[0]
    proc = run_cli("eval", f"--workdir={workdir}")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) >= {"step", "loss", "perplexity", "tokens"} and result["step"] == 12
    assert abs(result["loss"] - reference_run[1]["loss"]) < 1e-5
    proc = run_cli("generate", f"--workdir={workdir}", "--prompt=It is a truth", "--max_new_tokens=8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("It is a truth")


def test_a_config_saved_before_later_keys_resumes_exactly_and_evaluates(tmp_path, reference_run):
    """A run directory whose config.json predates keys added since (`nlearn.config.MIGRATIONS`): it
    resumes from a mid-run checkpoint to the reference run's loss, and nlearn-eval scores it."""
    from nlearn.eval.restore import load_run_config
    from nlearn.train import train_and_evaluate

    workdir = tmp_path / "old"
    shutil.copytree(reference_run[0], workdir)
    for step in ("9", "12"):
        shutil.rmtree(workdir / "checkpoints" / step)
    saved = json.load(open(workdir / "config.json"))
    for key in ("schedule", "decay_fraction", "final_eval", "cpu_opt_preset", "time_budget_s"):
        del saved["train"][key]
    json.dump(saved, open(workdir / "config.json", "w"))
    config = load_run_config(str(workdir))
    assert config.train.schedule == "cosine" and config.train.final_eval and config.train.time_budget_s == 0
    result = train_and_evaluate(config, str(workdir))
    assert result["step"] == 12 and abs(result["loss"] - reference_run[1]["loss"]) <= 1e-6
    json.dump(saved, open(workdir / "config.json", "w"))  # the trainer rewrote it with today's keys
    proc = run_cli("eval", f"--workdir={workdir}")
    assert proc.returncode == 0, proc.stderr
    assert abs(json.loads(proc.stdout.strip().splitlines()[-1])["loss"] - result["loss"]) < 1e-5


def test_migrate_adds_only_the_keys_a_family_has():
    from nlearn.config import MIGRATIONS, migrate, validate
    from nlearn.memory_config import DECAY_INIT

    import ml_collections

    mac = load_family_config("titans_mac").to_dict()
    for section, key in [("model", "mac_output"), ("model", "mac_memory_input"), ("model", "attn_conv_size"),
                         ("train", "final_eval")]:
        del mac[section][key]
    del mac["model"]["memory"]["decay_init"], mac["model"]["memory"]["conv_init"], mac["data"]["mqar"]
    old = migrate(ml_collections.ConfigDict(mac))
    validate(old)
    assert (old.model.mac_output, old.model.mac_memory_input, old.model.attn_conv_size) == ("gate", "x+y", 0)
    assert old.model.memory.decay_init == DECAY_INIT and old.model.memory.conv_init == "identity"
    assert "mqar" not in old.data  # no section, nothing to add to
    plain = migrate(golden_config())
    assert "mac_output" not in plain.model and "memory" not in plain.model
    assert all(key.count(".") >= 1 for key, _, _ in MIGRATIONS)


@pytest.mark.slow
def test_sharded_run_matches_single_device(tmp_path, cache_dir, text_corpus, reference_run):
    """8 host devices as data=2 x fsdp=2 x tensor=2 give the single-device eval loss."""
    cmd = _train_cmd(tmp_path, cache_dir, text_corpus, **{
        "train.steps": 12, "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    result = _final(proc)
    assert "'data': 2, 'fsdp': 2, 'tensor': 2" in proc.stdout
    sharded = [l for l in proc.stdout.splitlines() if l.startswith("sharding:")][0]
    assert not sharded.startswith("sharding: 0 "), sharded
    assert abs(result["loss"] - reference_run[1]["loss"]) / reference_run[1]["loss"] <= 1e-3


@pytest.mark.slow  # the generic staged-source resume test covers the mechanism in the default suite
def test_mqar_curriculum_run_resumes_across_the_stage_change(tmp_path):
    """A curriculum changes the batch shape mid-run (one more compile); a run that ends inside the
    first stage and is then extended ends exactly where an uninterrupted run does."""
    def cmd(workdir, steps):
        return ["--config=benchmarks/configs/mqar.py:deltanet", f"--workdir={workdir}", *[
            f"--config.{k}={v}" for k, v in {
                "model.d_model": 32, "model.num_layers": 1, "model.mlp_dim": 32, "data.vocab_size": 64,
                "train.seq_len": 32, "train.batch_size": 2, "train.steps": steps, "train.log_every": 2,
                "data.mqar.num_pairs": 4, "data.mqar.eval_examples": 8, "data.mqar.curriculum": "16x2:3",
                "checkpoint.every_steps": 2, "train.peak_gflops": 100.0,
                "train.min_lr_ratio": 1.0, "train.warmup_steps": 1,  # an lr that ignores train.steps
                "logging.wandb_mode": "disabled"}.items()]]

    straight = run_cli("train", *cmd(tmp_path / "straight", 5))
    first = run_cli("train", *cmd(tmp_path / "resumed", 2), "--config.train.final_eval=False")
    assert first.returncode == 0, first.stdout + first.stderr
    # Without its final evaluation the run ends at its last checkpoint and says how to score it.
    assert not (tmp_path / "resumed" / "eval.json").exists() and "score it with nlearn-eval" in first.stdout
    resumed = run_cli("train", *cmd(tmp_path / "resumed", 5))
    for proc in (straight, resumed):
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resuming from checkpoint at step 2" in resumed.stdout
    a, b = (json.load(open(tmp_path / d / "eval.json")) for d in ("straight", "resumed"))
    assert a["step"] == b["step"] == 5 and np.isfinite(a["mqar_accuracy"])
    assert abs(a["loss"] - b["loss"]) <= 1e-6
    bad = run_cli("train", *cmd(tmp_path / "bad", 5), "--config.data.mqar.curriculum=16x4")
    assert bad.returncode != 0 and "data.mqar.curriculum: cannot read stage '16x4'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def schedule_config(schedule: str):
    config = golden_config()
    config.train.update(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1, schedule=schedule,
                        decay_fraction=0.3)
    return config


def test_wsd_holds_the_peak_then_decays_linearly_to_the_floor():
    from nlearn.train.optim import learning_rate

    wsd, cosine = learning_rate(schedule_config("wsd")), learning_rate(schedule_config("cosine"))
    np.testing.assert_allclose([float(wsd(s)) for s in (0, 5, 10, 40, 70, 85, 100, 150)],
                               [0.0, 0.5, 1.0, 1.0, 1.0, 0.55, 0.1, 0.1], rtol=1e-6, atol=1e-7)
    # cosine: halfway through the decay (step 55 of 10..100) it is halfway between peak and floor
    np.testing.assert_allclose([float(cosine(s)) for s in (10, 55, 100)], [1.0, 0.55, 0.1], rtol=1e-6)
    # train.decay_steps: the cosine of a 60-step run, then the floor until step 100
    config = schedule_config("cosine")
    config.train.decay_steps = 60
    early, short = learning_rate(config), schedule_config("cosine")
    short.train.steps = 60
    short = learning_rate(short)
    np.testing.assert_allclose([float(early(s)) for s in range(0, 101, 5)],
                               [float(short(min(s, 60))) for s in range(0, 101, 5)], rtol=1e-6)
    assert float(early(80)) == pytest.approx(0.1)


@pytest.mark.parametrize("key,value", [("schedule", "linear"), ("decay_fraction", 0.0),
                                       ("decay_fraction", 1.5), ("decay_steps", 50), ("decay_steps", -1)])
def test_bad_schedule_values_are_refused(key, value):
    from nlearn.config import validate
    from nlearn.errors import UserError

    config = schedule_config("wsd")
    config.train[key] = value
    with pytest.raises(UserError, match=f"train.{key}"):
        validate(config)


def test_configs_saved_before_the_schedule_keys_migrate_to_cosine():
    from nlearn.config import migrate, validate
    from nlearn.train.optim import learning_rate

    import ml_collections

    saved = schedule_config("wsd").to_dict()  # as load_run_config reads an old config.json
    del saved["train"]["schedule"], saved["train"]["decay_fraction"], saved["train"]["cpu_opt_preset"]
    old = migrate(ml_collections.ConfigDict(saved))
    validate(old)
    assert old.train.schedule == "cosine" and old.train.cpu_opt_preset == "default"
    assert float(learning_rate(old)(55)) == pytest.approx(float(learning_rate(schedule_config("cosine"))(55)))


def test_cpu_opt_preset_reaches_the_compiler_and_a_bad_one_is_refused():
    from nlearn.config import validate
    from nlearn.errors import UserError
    from nlearn.train.cpu_preset import compiler_options

    config = golden_config()
    assert compiler_options(config.train) is None  # XLA's defaults
    config.train.cpu_opt_preset = "fast_compile"
    options = compiler_options(config.train)
    assert options == {"xla_cpu_opt_preset": "CPU_OPT_PRESET_FAST_COMPILE"}
    x = jnp.arange(4.0)
    np.testing.assert_array_equal(jax.jit(lambda v: v * 2, compiler_options=options)(x), x * 2)
    config.train.cpu_opt_preset = "fastest"
    with pytest.raises(UserError, match="train.cpu_opt_preset"):
        validate(config)


def test_mfu_peak_counts_the_cpu_once_however_many_devices_it_is_split_into():
    """Forced CPU devices share the process's cores: MFU's peak must not multiply by them."""
    code = "import jax; from nlearn.train.flops import run_peak_flops; print(jax.device_count(), run_peak_flops(100.0))"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["4", "100000000000.0"]


def test_wsd_with_a_traced_total_is_the_optax_schedule():
    """A time-budgeted run feeds its total to the WSD schedule as a traced scalar."""
    from nlearn.train.optim import learning_rate, wsd_total

    # (95, 10, 0.3): 0.3 * 95 rounds to 28 in float64 but 29 in float32, so the boundary must come in
    # computed by Python (wsd_total), not be recomputed from a traced total.
    for steps, warmup, fraction in ((100, 10, 0.3), (95, 10, 0.3), (790, 20, 0.5), (57, 0, 0.2), (3, 5, 0.5)):
        config = schedule_config("wsd")
        config.train.update(steps=steps, warmup_steps=warmup, decay_fraction=fraction, lr=3e-3)
        counts = jnp.arange(steps + 5)
        fixed = jax.jit(jax.vmap(learning_rate(config)))(counts)
        traced = jax.jit(lambda c, total: jax.vmap(learning_rate(config, total))(c))(
            counts, wsd_total(config, steps))
        np.testing.assert_allclose(traced, fixed, rtol=1e-6, atol=1e-12)


def test_budget_planning_fits_the_steps_and_keeps_the_schedule_so_far():
    from nlearn.train.time_budget import fit_total, shortest_total
    from nlearn.train.optim import wsd_stable_end

    # 100 s left at 1 s per step (98% of it usable): 98 more steps, capped by the configured total.
    assert fit_total(300, 1100, elapsed_s=200, step_s=1.0, budget_s=300) == 398
    assert fit_total(300, 350, elapsed_s=200, step_s=1.0, budget_s=300) == 350
    assert fit_total(300, 1100, elapsed_s=200, step_s=0.5, budget_s=300, extra_s_per_step=0.5) == 398
    # Out of time: the shortest total whose stable phase still covers the steps taken.
    shortest = shortest_total(300, 1100, warmup=20, decay_fraction=0.5)
    assert shortest == 600 and wsd_stable_end(599, 20, 0.5) < 300 <= wsd_stable_end(600, 20, 0.5)
    assert fit_total(300, 1100, elapsed_s=400, step_s=1.0, budget_s=300, shortest=shortest) == 600
    assert shortest_total(700, 1100, warmup=20, decay_fraction=0.5) == 1100  # already decaying: no change


@pytest.mark.parametrize("overrides,message", [
    ({"time_budget_s": -1.0}, "must be >= 0"),
    ({"time_budget_s": 60.0, "schedule": "cosine"}, "needs train.schedule=wsd")])
def test_bad_time_budgets_are_refused(overrides, message):
    from nlearn.config import validate
    from nlearn.errors import UserError

    config = schedule_config("wsd")
    config.train.update(overrides)
    with pytest.raises(UserError, match=f"train.time_budget_s.*{message}"):
        validate(config)


@pytest.mark.slow
def test_time_budget_shortens_the_run_to_the_one_its_total_gives(tmp_path, cache_dir, text_corpus):
    """A 1 s budget is spent before the plan (start-up alone takes longer), so the run takes the
    shortest total that keeps its schedule so far (11 of 40: WSD over 11 steps with 2 decaying is
    still stable at step 9, the plan). It must end as a plain 11-step run does, and a rerun keeps 11."""
    wsd = {"train.schedule": "wsd"}
    budgeted = _train_cmd(tmp_path / "budget", cache_dir, text_corpus,
                          **wsd, **{"train.steps": 40, "train.time_budget_s": 1.0})
    first = subprocess.run(budgeted, cwd=ROOT, capture_output=True, text=True, timeout=600)
    result = _final(first)
    assert "time budget 1s" in first.stdout and "training 11 of 40 steps" in first.stdout
    assert "the fewest that keep the lr of the steps so far" in first.stdout
    assert result["step"] == 11
    assert json.load(open(tmp_path / "budget" / "budget.json"))["planned_steps"] == 11
    plain = _final(subprocess.run(_train_cmd(tmp_path / "plain", cache_dir, text_corpus, **wsd, **{"train.steps": 11}),
                                  cwd=ROOT, capture_output=True, text=True, timeout=600))
    assert abs(result["loss"] - plain["loss"]) <= 1e-5
    again = subprocess.run(budgeted, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert "resuming from checkpoint at step 11" in again.stdout and _final(again)["step"] == 11
