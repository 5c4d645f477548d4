"""Offline corpus preparation: text, JSONL or Parquet in, tokenized WebDataset shards out."""


class PrepError(Exception):
    """Bad input or settings; the message names the file, field or value."""
