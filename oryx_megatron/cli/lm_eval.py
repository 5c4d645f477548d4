"""lm-evaluation-harness's command line with the Oryx checkpoint model ``oryx`` registered
(``eval.lm_eval_harness``; docs/inference.md):

    python -m oryx_megatron.cli.lm_eval run --model oryx \\
        --model_args checkpoint=runs/ckpt,schedule=all_attention,batch_size=8 --tasks hellaswag
"""

import oryx_megatron.eval.lm_eval_harness  # noqa: F401  (registers the lm-eval model "oryx")


def main() -> None:
    """lm-eval's own command line (its arguments and errors are lm-eval's)."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
