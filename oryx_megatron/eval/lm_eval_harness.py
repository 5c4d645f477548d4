"""lm-evaluation-harness on an Oryx checkpoint: the lm-eval model ``oryx``.

    python -m oryx_megatron.cli.lm_eval run --model oryx \\
        --model_args checkpoint=runs/ckpt,schedule=all_attention,batch_size=8 \\
        --tasks hellaswag --include_path my_tasks/

(``lm_eval --model oryx`` itself only finds the model once this module is imported: from
Python, ``import oryx_megatron.eval.lm_eval_harness`` before ``lm_eval.simple_evaluate``;
from the shell, run lm-eval through ``python -m oryx_megatron.cli.lm_eval``, which
takes exactly lm-eval's command line.)

model_args: ``checkpoint`` (a checkpoint dir or a run's checkpoint.dir), ``schedule`` (an
inference schedule, default ``all_attention``; model_args are comma-separated, so write the
commas of a schedule as ';': ``schedule=linear:0-64;attention:64-``), ``batch_size``,
``max_length`` (default the model's max_sequence_length), ``device``, ``dtype``
(float32 | bfloat16), ``tokenizer`` ('byte' or a tokenizer.json; default the dataset's).
The requests are answered by ``eval.lm_eval_adapter.OryxLM``.
"""

from typing import Optional

import torch
from lm_eval.api.registry import register_model
from lm_eval.utils import simple_parse_args_string

from oryx_megatron.eval.lm_eval_adapter import OryxLM
from oryx_megatron.inference.loading import dataset_tokenizer, load_for_inference


@register_model("oryx")
class OryxCheckpointLM(OryxLM):
    """``OryxLM`` of a checkpoint and its dataset's tokenizer, built from lm-eval's model_args."""

    def __init__(self, checkpoint: str, schedule: str = "all_attention", batch_size=1,
                 max_length: Optional[int] = None, device: Optional[str] = None, dtype: Optional[str] = None,
                 tokenizer: Optional[str] = None, max_batch_size=None, **kwargs):
        if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
            device = None  # lm-eval's CLI defaults to cuda
        model, run = load_for_inference(str(checkpoint), device, dtype)
        super().__init__(model, dataset_tokenizer(run, tokenizer), str(schedule).replace(";", ","), batch_size,
                         max_length)
        self.run = run

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None):
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: Optional[dict] = None):
        """model_args win over lm-eval's own settings (its CLI always passes batch_size)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**extra, **arg_dict})
