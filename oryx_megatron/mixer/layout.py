"""The layout of the Oryx mixer's fused input projection: which streams it holds per head, in which order,
and which of them get a short conv; and the projections of the hidden state that every head reads (a linear
mixer's cross-head features). The mixer core, both front ends and the weight conversions read it."""

import dataclasses
from typing import Dict, Optional, Tuple

from oryx_megatron.config import MixerConfig
from oryx_megatron.mixer.linear import linear_mixer_class


@dataclasses.dataclass(frozen=True)
class MixerLayout:
    """``streams``: stream -> per-head width of ``in_proj``'s rows, head-major and in this order (per head: k, v,
    g, [k_gate, v_gate], [q_attn], then the linear mixer's streams), so a column-parallel split hands each
    rank whole heads; ``conv_streams``: the streams with a short conv (parameters ``conv_<stream>``);
    ``attention_query``: the stream attention reads with (None without attention); ``linear_streams``: the
    linear mixer's own streams; ``hidden_features``: feature -> width of the linear mixer's projections of the
    hidden state that every head reads (``LinearMixer.hidden_projections``: one fused ``hidden_proj``, replicated
    over tensor-parallel ranks; none by default)."""

    streams: Dict[str, int]
    conv_streams: Tuple[str, ...]
    attention_query: Optional[str]
    linear_streams: Tuple[str, ...]
    hidden_features: Dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, config: MixerConfig) -> "MixerLayout":
        d_k, d_v = config.kv_channels, config.value_head_dim
        streams = {"k": d_k, "v": d_v, "g": d_v}
        if config.kv_gate != "none":
            streams.update(k_gate=d_k, v_gate=d_v)
        conv = ["k", "v"]
        if config.has_attention and not config.shared_query:
            streams["q_attn"] = d_k
        linear = linear_mixer_class(config)
        linear_streams = {} if linear is None else linear.streams(config)
        streams.update(linear_streams)
        if linear is not None:
            conv += linear.conv_streams
        if "q_attn" in streams and config.attention_query_conv:
            conv.append("q_attn")
        query = None if not config.has_attention else ("q_lin" if config.shared_query else "q_attn")
        hidden_features = {} if linear is None else linear.hidden_projections(config)
        return cls(streams, tuple(conv), query, tuple(linear_streams), hidden_features)

    @property
    def width(self) -> int:
        """Rows of ``in_proj`` per head."""
        return sum(self.streams.values())

    @property
    def conv_widths(self) -> Tuple[int, ...]:
        """Per-head widths of the conv streams, in ``conv_streams`` order."""
        return tuple(self.streams[name] for name in self.conv_streams)

    @property
    def conv_width(self) -> int:
        """Channels per head of the short convs, side by side (the mixer runs them as one depthwise conv)."""
        return sum(self.conv_widths)
