"""oryx-params: parameter counts of a model recipe, and how much the two modes share.

    oryx-params model=oryx_tg_1_4b            # any recipe under recipes/model
    oryx-params model=tiny_oryx_tg model.ffn_hidden_size=512

Arguments are Hydra overrides of recipes/oryx_params.yaml; ``--debug`` shows an error's
traceback. The model is built on the meta device (``models.params``: what the fractions mean).
"""

import sys
from typing import List, Optional

from oryx_megatron.cli.errors import DEBUG_FLAG, InputError, run_command
from oryx_megatron.config.pattern import ORYX_BLOCK, pattern_letters
from oryx_megatron.models.params import COMPONENTS, load_model_args, parameter_report


def _main(argv: List[str]) -> int:
    overrides = [a for a in argv if a != DEBUG_FLAG]
    if any(a in ("-h", "--help") for a in overrides):
        print(__doc__)
        return 0
    flags = [a for a in overrides if a.startswith("-")]
    if flags:
        raise InputError(f"unrecognized argument {flags[0]} (arguments are overrides such as model=oryx_tg_1_4b)")
    args = load_model_args(overrides)
    report = parameter_report(args)
    config, counts = report["config"], report["counts"]
    print(f"model: family={args.family} layers={args.num_layers} hidden={args.hidden_size} "
          f"heads={args.num_attention_heads} d_k={config.kv_channels} "
          f"d_v={getattr(config, 'value_head_dim', config.kv_channels)} ffn={config.ffn_hidden_size} "
          f"vocab={args.vocab_size} tied_embeddings={args.share_embeddings_and_output_weights}")
    if args.layer_pattern is not None:
        letters = pattern_letters(args.layer_pattern)
        print(f"layer_pattern={args.layer_pattern!r}: " + " ".join(f"{letter}={letters.count(letter)}"
                                                                   for letter in dict.fromkeys(letters))
              + " (the mixer fractions below are the Oryx blocks')" * (ORYX_BLOCK in letters))
    print(f"total_params={report['total']:,}")
    for component in COMPONENTS + ("other",):
        if counts.get(component):
            print(f"  {component:<16}{counts[component]:>15,}")
    for use in ("shared", "attention", "linear"):
        print(f"  mixer_{use:<10}{counts.get(f'mixer_{use}', 0):>15,}")
    print("# whole model: parameters both modes use / all parameters the mode uses")
    for mode, fraction in report["tied_fraction"].items():
        print(f"tied_fraction[{mode}]={fraction:.4f}")
    print(f"shared_fraction={report['shared_fraction']:.4f}")
    print("# mixer alone: shared mixer parameters / mixer parameters the mode uses")
    for mode, fraction in report["mixer_tied_fraction"].items():
        print(f"mixer_tied_fraction[{mode}]={fraction:.4f}")
    print(f"mixer_shared_fraction={report['mixer_shared_fraction']:.4f}")
    print(f"single_mixer_fraction={report['single_mixer_fraction']:.4f}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return run_command("oryx-params", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
