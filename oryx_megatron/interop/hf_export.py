"""``oryx-export hf``: a training checkpoint (any TP/PP layout) as a transformers model folder.

    config.json              OryxHFConfig (model_type "oryx", auto_map) or LlamaConfig (the Transformer)
    model.safetensors        weights in the asked dtype (SSM scalars fp32); sharded with an index above
                             max_shard_size, as save_pretrained does
    configuration_oryx.py, modeling_oryx.py   trust_remote_code=True (Oryx only): re-export this package
    generation_config.json   EOD as bos / eos / pad; the padded ids suppressed
    tokenizer.json, tokenizer_config.json     the run's dataset tokenizer, EOD as its special token
    README.md                a model card stub: family, size, tokens trained, held-out loss per schedule
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import torch
from transformers import GenerationConfig

from oryx_megatron.hf.tokenizer import hf_tokenizer
from oryx_megatron.interop.hf_convert import hf_config, hf_model, megatron_to_hf
from oryx_megatron.models.builder import padded_vocab_size
from oryx_megatron.run_config import TrainConfig

DEFAULT_SHARD_SIZE = "5GB"


@dataclass(frozen=True)
class TokenizerFiles:
    """The run's tokenizer: its ``tokenizer.json`` (None: the byte tokenizer), EOD token and id, vocab size."""

    path: Optional[Path]
    eod_token: str
    eod_id: int
    vocab_size: int


def export_model(model: torch.nn.Module, run: TrainConfig, out_dir: Path, dtype: torch.dtype = torch.float32,
                 tokenizer: Optional[TokenizerFiles] = None, iteration: Optional[int] = None,
                 heldout: Optional[Dict[str, float]] = None, max_shard_size: str = DEFAULT_SHARD_SIZE) -> Path:
    """Write the folder of a megatron model (TP = PP = 1, e.g. ``inference.checkpoint.load_model``'s) trained
    by ``run``, at ``iteration``; ``heldout``: held-out loss per schedule, for the card. The folder is built
    beside ``out_dir`` and moved there when complete; an existing ``out_dir`` is replaced."""
    if tokenizer is not None and tokenizer.vocab_size > run.model.vocab_size:
        raise ValueError(f"the tokenizer's vocab ({tokenizer.vocab_size}) is larger than the model's "
                         f"model.vocab_size={run.model.vocab_size}")
    out_dir = Path(out_dir)
    config = hf_config(run.model, run, None if tokenizer is None else tokenizer.eod_id, iteration, heldout)
    hf = hf_model(config, megatron_to_hf(model.state_dict(), config), dtype)
    if tokenizer is not None:
        padded = padded_vocab_size(run.model)
        hf.generation_config = GenerationConfig(bos_token_id=tokenizer.eod_id, eos_token_id=tokenizer.eod_id,
                                                pad_token_id=tokenizer.eod_id,
                                                suppress_tokens=list(range(tokenizer.vocab_size, padded)) or None)
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        hf.save_pretrained(partial, max_shard_size=max_shard_size)
        if tokenizer is not None:
            hf_tokenizer(tokenizer.path, tokenizer.eod_token, run.model.max_sequence_length).save_pretrained(partial)
        (partial / "README.md").write_text(model_card(config, hf, run))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(out_dir, ignore_errors=True)
    partial.rename(out_dir)
    return out_dir


def heldout_losses(metrics: Path, iteration: int) -> Dict[str, float]:
    """eval/loss_<schedule> of the last eval row at or before ``iteration`` in a run's metrics.jsonl."""
    found = {}
    for line in Path(metrics).read_text().splitlines():
        row = json.loads(line)
        if row["iteration"] <= iteration:
            losses = {key[len("eval/loss_"):]: value for key, value in row.items() if key.startswith("eval/loss_")}
            found = losses or found
    return found


def model_card(config, model: torch.nn.Module, run: TrainConfig) -> str:
    """A model card stub: family, size, tokens trained, held-out loss per schedule (when known)."""
    meta = config.oryx
    params = sum(p.numel() for p in model.parameters())
    tokens = meta.get("tokens_trained")
    lines = [
        "---", "library_name: transformers", f"tags: [oryx-megatron, {meta['family']}]", "---", "",
        f"# {meta['family']}, {params / 1e6:.1f}M parameters", "",
        f"An `{meta['family']}` model trained with oryx-megatron and exported by `oryx-export hf` (docs/hf.md).", "",
        "| | |", "|---|---|",
        f"| family | {meta['family']} ({getattr(config, 'mixers', 'transformer')}) |",
        f"| parameters | {params:,} |",
        *([f"| layer pattern | `{config.layer_pattern}` |"] if getattr(config, "layer_pattern", None) else []),
        f"| layers x hidden x heads | {config.num_hidden_layers} x {config.hidden_size} x "
        f"{config.num_attention_heads} |",
        f"| vocab (padded) | {meta['model']['vocab_size']} ({config.vocab_size}) |",
        f"| iteration | {meta.get('iteration', 'unknown')} |",
        f"| tokens trained | {f'{tokens:,}' if tokens is not None else 'unknown'} |",
        f"| training mode schedule | {getattr(config, 'training_mode_schedule', None) or '-'} |",
        f"| packed documents reset at EOD | {run.data.reset_at_eod} |",
        "",
    ]
    heldout = meta.get("heldout_loss")
    if heldout:
        lines += ["Held-out loss per mode schedule (the run's eval at or before this iteration):", "",
                  "| schedule | loss |", "|---|---|", *(f"| {k} | {v:.4f} |" for k, v in heldout.items()), ""]
    else:
        lines += ["Held-out loss: not recorded with the checkpoint "
                  "(`oryx-export hf ... --metrics RUN_DIR/metrics.jsonl`).", ""]
    if meta["family"] != "transformer":
        lines += ["Load with `import oryx_megatron.hf` first, or `trust_remote_code=True` where oryx-megatron is "
                  "installed; `model.generate(ids, schedule=\"prefill=linear decode=attention\")` picks the modes.", ""]
    return "\n".join(lines)
