"""The experiment driver behind ``oryx-experiment``: train, evaluate and tabulate one experiment of
recipes/experiment/.

An experiment lists model recipes, variants (extra oryx-train overrides), seeds, the
oryx-train overrides every run shares and one evaluation (an oryx-eval task). Every run
trains in this process into <out>/runs/<model>-s<seed>-<hash of its config>/ and is
reused while its config is unchanged: experiments that share runs (E3 evaluates E2's) train
them once, and a rerun after a crash only trains what is missing. Results go to
<out>/<experiment>/: results.json (every run's rows and the means over seeds), results.md
(the table) and a PNG (bars of the first metric, or the mode-switch curves).

Fair baselines: ``match_params`` names the model whose parameter count the others match
(their ``ffn_hidden_size``, models/match_width.py); ``lrs`` is a learning-rate grid swept per
(variant, model): each lr trains ``sweep_seeds`` runs, ``choose_lr`` picks the lr of the
lowest validation loss (eval/validation.py: MQAR samples of a seed of their own, not the
test set's nor training's) and the experiment's seeds then train and are tested at that lr.
The selection sees validation losses only: the test evaluation runs after it. Tables give
mean ± std over seeds and every seed's value.

Modules: ``config`` (the schema of an experiment file and its checks), ``runs`` (one run: its
config, key, training or reuse; width matching and the learning-rate choice), ``driver``
(``run_experiment``), ``tables`` and ``plots`` (what it writes).
"""
