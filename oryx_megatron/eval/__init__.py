"""Evaluation: synthetic retrieval tasks (``eval.tasks``)."""
