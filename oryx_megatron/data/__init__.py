"""Training data: token shards and Megatron indexed datasets in, batches with modes out.

Modules (the data code knows no model code):

- ``modes``: ``ModeSchedule`` and ``build_mode_schedule`` (which mixer reads each token);
- ``schedules``: the mode schedules of inference (a prompt and its continuation), parsed from text: what the
  megatron model's generation and the Hugging Face model's both read;
- ``documents``: ``document_ids`` (the document of each token of a packed sequence);
- ``shards``: the dataset format shared with ``prep`` (manifest + WebDataset shards);
- ``loader``: ``ShardLoader``, deterministic and resumable, plus ``parse_blend``;
- ``prep``: ``oryx-prep``'s library: inputs, tokenizers, the parallel and resumable tokenizer into shards;
- ``indexed``: ``IndexedLoader`` over Megatron ``.bin/.idx`` data (imports megatron.core).
"""
