"""Evaluation of checkpoints: held-out perplexity per mode schedule (``ppl``), mode switching
(``mode_switch``), retrieval accuracy (``retrieval``, on the tasks of ``data.tasks``) and the
lm-eval-harness adapter (``lm_eval_adapter``)."""
