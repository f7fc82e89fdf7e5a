"""Train a model: `python scripts/train.py --config=configs/transformer.py:tiny --workdir=runs/tf`."""

from nlearn.cli.train import run

if __name__ == "__main__":
    run()
