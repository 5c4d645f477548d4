"""The run's tokenizer as a transformers tokenizer: its ``tokenizer.json`` (a byte-level BPE of ``oryx-prep``),
or, for the byte tokenizer of the tests and demos, a BPE without merges over the 256 bytes (id = byte value)
plus the EOD token (256). The EOD token is bos, eos and pad: lm-eval's ``hf`` backend then reads an empty
context as [EOD], as the project's adapter does."""

from pathlib import Path
from typing import Optional

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def byte_tokenizer(eod_token: str) -> Tokenizer:
    """UTF-8 bytes as ids 0-255 (through the GPT-2 byte-to-unicode alphabet) and ``eod_token`` as 256."""
    stand_in = _byte_stand_ins()
    tokenizer = Tokenizer(models.BPE(vocab={stand_in[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(eod_token, special=True)])
    return tokenizer


def _byte_stand_ins() -> dict:
    """byte -> its stand-in character in the byte-level pre-tokenizer's alphabet (GPT-2's ``bytes_to_unicode``:
    printable bytes stand for themselves, the others for 256, 257, ... in byte order)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(others)) for b in range(256)}


def hf_tokenizer(tokenizer_json: Optional[Path], eod_token: str, model_max_length: int) -> PreTrainedTokenizerFast:
    """The transformers tokenizer of ``tokenizer_json`` (None: the byte tokenizer) with ``eod_token`` as its
    bos / eos / pad token; documents are encoded without special tokens, as oryx-prep encodes them."""
    tokenizer = byte_tokenizer(eod_token) if tokenizer_json is None else Tokenizer.from_file(str(tokenizer_json))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=eod_token, eos_token=eod_token,
                                   pad_token=eod_token, model_max_length=model_max_length,
                                   clean_up_tokenization_spaces=False)
