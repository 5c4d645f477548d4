"""A linear mixer is one class and one registration (docs/model.md, "Adding a linear mixer"): this module adds a
third one, a RetNet-style retention with a fixed decay per head, and runs it through what the project proves of
its mixers: the parallel forward equals step-by-step decode (fp64), TP=2 equals TP=1, a checkpoint saves and
loads, the Hugging Face export computes the same logits.

    S_t = exp(-exp(A_log)) S_{t-1} + k_t v_t^T,   o_t = S_t^T q_t / sqrt(d_k)

(Mamba-2's SSD scan with every time step 1: the ops exist, so the class is its parameters and their use.)
"""

import math
from typing import Dict, Optional, Tuple

import pytest
import torch
from torch import Tensor

from oryx_megatron.config import MixerConfig
from oryx_megatron.mixer import LINEAR_MIXERS, LinearMixer
from oryx_megatron.models.builder import build_model, transformer_config
from oryx_megatron.ops import Documents
from tests.distributed import run_distributed
from tests.helpers import build_mixer, tiny_args
from tests.test_multi_mixer import hidden_states, random_modes, run_decode, run_parallel
from tests.test_tensor_parallel import tp_equals_tp1

MIXERS = "attention+retention"


class Retention(LinearMixer):
    """Streams q_lin [d_k]; parameter A_log, one decay per head (RetNet's: 1 - 2^(-5 - h), fixed at init)."""

    def __init__(self, config: MixerConfig, shard, kernels):
        super().__init__(config, shard, kernels)
        self.add_scalar_params({"A_log": ((config.num_attention_heads,), self._retnet_decays)})

    @staticmethod
    def streams(config: MixerConfig) -> Dict[str, int]:
        return {"q_lin": config.kv_channels}

    def forward(self, x: Dict[str, Tensor], initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                documents: Optional[Documents] = None) -> Tuple[Tensor, Optional[Tensor]]:
        q, k = self._query_key(x)  # [b, s, h, d_k]
        return self.kernels.ssd_chunk_scan(x["v"], torch.ones_like(q[..., 0]), self.A, k, q,
                                           initial_state=initial_state, output_final_state=output_final_state,
                                           chunk_size=self.config.linear_chunk_size, documents=documents)

    def step(self, x: Dict[str, Tensor], state: Tensor) -> Tuple[Tensor, Tensor]:
        q, k = self._query_key(x)  # [b, h, d_k]
        return self.kernels.ssd_step(x["v"], torch.ones_like(q[..., 0]), self.A, k, q, state)

    def _query_key(self, x: Dict[str, Tensor]) -> Tuple[Tensor, Tensor]:
        return x["q_lin"] / math.sqrt(self.d_k), x["k"]

    @staticmethod
    def _retnet_decays(shape) -> Tensor:
        return (-torch.log1p(-2.0 ** (-5 - torch.arange(shape[0], dtype=torch.float64)))).log().float()


@pytest.fixture(autouse=True)
def retention(monkeypatch):
    """The registration: one entry in LINEAR_MIXERS."""
    monkeypatch.setitem(LINEAR_MIXERS, "retention", Retention)


def test_a_recipe_names_the_new_mixer_and_a_family_fixes_its_own():
    args = tiny_args("oryx", mixers=MIXERS)
    assert args.linear_mixer == "retention" and transformer_config(args).mixers == MIXERS
    with pytest.raises(ValueError, match=r"model.mixers='attention\+retention': family 'oryx_tg' has the mixers"):
        tiny_args("oryx_tg", mixers=MIXERS)


@pytest.mark.usefixtures("single_process_parallel")
@pytest.mark.parametrize("prefill", [0, 13])
def test_parallel_forward_equals_step_by_step_decode(prefill):
    mixer = build_mixer("oryx", mixers=MIXERS)
    assert isinstance(mixer.linear_mixer, Retention)
    bf16 = tiny_args("oryx", mixers=MIXERS)
    bf16 = build_model(bf16, transformer_config(bf16, params_dtype=torch.bfloat16, bf16=True))
    assert bf16.decoder.layers[0].mixer.linear_mixer.A_log.dtype == torch.float32  # add_scalar_params: fp32
    x, modes = hidden_states(40), random_modes(41, chunk=4)
    assert (run_decode(mixer, x, modes, prefill=prefill) - run_parallel(mixer, x, modes)).abs().max() < 1e-9
    linear, attention = (run_parallel(mixer, x, torch.full_like(modes, m)) for m in (0, 1))
    assert (linear - attention).abs().max() > 1e-3


def _registered_tp_equals_tp1(tmp: str, level: str):
    LINEAR_MIXERS["retention"] = Retention  # each process registers it, as the module importing it would
    tp_equals_tp1(tmp, level, [("oryx", False), ("oryx", True)], mixers=MIXERS)


@pytest.mark.parametrize("level", ["mixer", "model"])
def test_tensor_parallel_equals_single_rank(tmp_path, level):
    run_distributed(_registered_tp_equals_tp1, str(tmp_path), level)


def test_checkpoint_and_hf_export_give_the_same_logits(single_process_parallel, tmp_path):
    from transformers import AutoModelForCausalLM

    from oryx_megatron.interop.hf_convert import hf_config, hf_model, megatron_to_hf, model_args
    from oryx_megatron.inference.checkpoint import load_model
    from oryx_megatron.run_config import TrainConfig
    from oryx_megatron.training.router import save_model

    args = tiny_args("oryx", mixers=MIXERS, kernel_backend="torch")
    torch.manual_seed(0)
    model = build_model(args, transformer_config(args)).eval()
    g = torch.Generator().manual_seed(42)
    ids, modes = torch.randint(0, args.vocab_size, (2, 29), generator=g), random_modes(42, chunk=8)
    with torch.no_grad():
        want = model(ids, modes)

    run = TrainConfig(model=args)
    run.checkpoint.dir = str(tmp_path / "ckpt")
    loaded, run = load_model(str(save_model(run, model, iteration=1)))  # the model-only checkpoint of a run
    assert run.model.mixers == MIXERS
    with torch.no_grad():
        assert torch.equal(loaded(ids, modes), want)

    config = hf_config(args)
    hf_model(config, megatron_to_hf(model.state_dict(), config)).save_pretrained(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert model_args(hf.config).mixers == MIXERS
    with torch.no_grad():
        assert (hf(ids, modes=modes).logits - want[..., : config.vocab_size]).abs().max() <= 1e-5
