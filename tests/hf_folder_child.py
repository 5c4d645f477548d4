"""Run by tests/test_hf_folder.py in a Python with torch and transformers only (``python -I``, neither
oryx_megatron nor megatron-core importable): load each exported folder with ``trust_remote_code=True``, compute
the logits of every case (parallel forward and cached decoding) and save each folder again (RESAVED_DIR/<i>, in the
order of RESULT.pt's "folders").

    python -I hf_folder_child.py CASES.pt RESULT.pt RESAVED_DIR
CASES.pt: [{"folder", "family", "schedule", "ids" [b, s], "modes" [b, s], "prompt"}, ...]
"""

import importlib.util
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM


def cached(model, ids, modes, prompt):
    """Prefill ``prompt`` tokens, then one token at a time through the model's cache: logits [b, s, V]."""
    cache = model.allocate_cache(ids.shape[0])
    logits = [model(ids[:, :prompt], modes=modes[:, :prompt], past_key_values=cache).logits]
    for t in range(prompt, ids.shape[1]):
        logits.append(model(ids[:, t:t + 1], modes=modes[:, t:t + 1], past_key_values=cache).logits)
    return torch.cat(logits, dim=1)


def main(cases_path: str, result_path: str, resaved: str) -> None:
    missing = [name for name in ("oryx_megatron", "megatron") if importlib.util.find_spec(name) is not None]
    assert not missing, f"importable here: {missing}"
    torch.manual_seed(0)
    models, results = {}, []
    with torch.no_grad():
        for case in torch.load(cases_path):
            if case["folder"] not in models:
                models[case["folder"]] = AutoModelForCausalLM.from_pretrained(case["folder"], trust_remote_code=True)
            model = models[case["folder"]].eval()
            results.append({"family": case["family"], "schedule": case["schedule"],
                            "parallel": model(case["ids"], modes=case["modes"]).logits,
                            "cached": cached(model, case["ids"], case["modes"], case["prompt"])})
        for i, model in enumerate(models.values()):
            model.save_pretrained(f"{resaved}/{i}")
    torch.save({"transformers": transformers.__version__, "model_module": type(model).__module__,
                "folders": list(models), "results": results}, result_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
