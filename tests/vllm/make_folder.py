"""Write each family's folder as `oryx-export hf` writes it, from a random megatron model, and the greedy tokens
`oryx-generate`'s engine gives with that model for every prompt and schedule of tests/vllm (run in the project's
.venv, which has megatron-core; tests/vllm/conftest.py calls it once per session):

    python tests/vllm/make_folder.py OUT     # OUT/<family>/ (a folder) and OUT/expected.json
"""

import atexit
import json
import shutil
import sys
import tempfile
from pathlib import Path

from tests import plugins

# the tests' mixer plugin, on the path before a registry is read (tests.test_hf reads it at import); the folder carries
# its code: vLLM's venv has no plugin
PLUGIN_TARGET = Path(tempfile.mkdtemp(prefix="oryx-plugins-"))
atexit.register(shutil.rmtree, PLUGIN_TARGET, ignore_errors=True)
plugins.install(PLUGIN_TARGET)

import torch  # noqa: E402

from oryx_megatron.inference.generation import generate  # noqa: E402
from oryx_megatron.parallel import initialize_parallel  # noqa: E402
from tests.helpers import PATTERN  # noqa: E402
from tests.test_hf import converted, megatron_model, tiny_args  # noqa: E402

FAMILIES = ("oryx_tg", "oryx_tm", "gdn", "mamba2", "transformer")  # the Transformer's folder: stock Llama
PATTERNS = {"oryx_tm_pattern": PATTERN}  # folder -> the layer pattern of every kind of layer (tests/helpers.py)
PLUGIN_MIXERS = {"lanorm": "attention+lanorm"}  # folder -> the mixers of the tests' mixer plugin (tests/plugins)
SCHEDULES = ("all_attention", "all_linear", "prefill=linear decode=attention", "linear_then_attention n_last=20")
NEW_TOKENS = 32


def prompts():
    """Three prompts: over one chunk of a 64-token prefill budget, under it, and of one token."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (150, 33, 1)]


def main(out: str) -> None:
    initialize_parallel()
    torch.set_num_threads(1)
    expected = {"prompts": prompts(), "new_tokens": NEW_TOKENS, "tokens": {}}
    for family in FAMILIES + tuple(PATTERNS) + tuple(PLUGIN_MIXERS):
        torch.manual_seed(0)
        args = tiny_args({**PATTERNS, **PLUGIN_MIXERS}.get(family, family))
        megatron = megatron_model(args)
        converted(megatron, args).save_pretrained(Path(out) / family)
        expected["tokens"][family] = {
            schedule: generate(megatron, expected["prompts"], schedule, NEW_TOKENS, vocab_size=args.vocab_size).tokens
            for schedule in (SCHEDULES if family != "transformer" else ("all_attention",))}
    (Path(out) / "expected.json").write_text(json.dumps(expected))


if __name__ == "__main__":
    main(*sys.argv[1:])
