"""nlearn-lm-eval: lm-evaluation-harness's own command line, with the `nlearn` model registered.

  nlearn-lm-eval --model nlearn --model_args pretrained=runs/titans_lmm-tiny --tasks hellaswag,piqa
  nlearn-lm-eval --model nlearn --model_args pretrained=RUN,rolling=window --tasks my_task --include_path DIR

Every flag is lm-eval's (`nlearn-lm-eval --help`); the model arguments are `nlearn.eval.harness.NlearnLM`'s.
"""

from nlearn.cli.common import configure_process, fail, quiet_libraries
from nlearn.errors import UserError


def run():
    configure_process()
    quiet_libraries()
    try:
        import nlearn.eval.harness  # noqa: F401  (registers `nlearn`; says what to install without lm-eval)
        from lm_eval.__main__ import cli_evaluate

        cli_evaluate()
    except UserError as e:
        fail(str(e))


if __name__ == "__main__":
    run()
