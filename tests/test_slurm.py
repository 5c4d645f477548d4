"""SLURM launch layer: distributed env of SLURM tasks, the sbatch scripts' commands and exit codes (run against
fake SLURM commands and a stub trainer), and the Hydra submitit launcher configs. What the scripts do when SLURM
signals a job is tested against a real SLURM: tests/slurm (`make test-slurm`)."""

import os
import signal
import stat
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import OmegaConf

from oryx_megatron import launch
from oryx_megatron.launch import (
    REQUEUE_EXIT_CODE,
    distributed_env_from_slurm,
    first_host,
)

REPO = Path(__file__).resolve().parents[1]
SLURM_DIR = REPO / "slurm"
RECIPES = REPO / "recipes"
JOB_ID = "123457"


# ---------------------------------------------------------------- distributed_env_from_slurm

def _task_env(**extra):
    env = {"SLURM_JOB_ID": JOB_ID, "SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5",
           "SLURM_JOB_NODELIST": "gpu[001-004,007]"}
    env.update(extra)
    return env


@pytest.mark.parametrize("nodelist, host", [
    ("gpu[001-004,007]", "gpu001"),
    ("gpu[007,001-004]", "gpu007"),
    ("a01,b02", "a01"),
    ("node7", "node7"),
    ("rack[3-4]-n[09-12],login1", "rack3-n09"),
    ("x[1,2],y[3-4]", "x1"),
])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["", "gpu[001-004", "gpu]1", ",a01"])
def test_first_host_rejects_malformed(nodelist):
    with pytest.raises(ValueError):
        first_host(nodelist)


def test_slurm_task_env():
    env = distributed_env_from_slurm(_task_env())
    assert env == {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "MASTER_ADDR": "gpu001",
                   "MASTER_PORT": str(20000 + int(JOB_ID) % 10000)}


def test_slurm_task_env_node_lists_and_port():
    # The step's node list wins over the job's; SLURM_NODELIST is the last resort.
    env = distributed_env_from_slurm(_task_env(SLURM_STEP_NODELIST="b[10-11]", SLURM_PROCID="9",
                                               SLURM_LOCALID="1"))
    assert (env["MASTER_ADDR"], env["RANK"], env["LOCAL_RANK"]) == ("b10", "9", "1")
    env = _task_env(SLURM_NODELIST="a01,b02")
    del env["SLURM_JOB_NODELIST"]
    assert distributed_env_from_slurm(env)["MASTER_ADDR"] == "a01"
    # MASTER_PORT from the environment is kept; otherwise it is stable per job and in range.
    assert distributed_env_from_slurm(_task_env(MASTER_PORT="31337"))["MASTER_PORT"] == "31337"
    ports = {int(distributed_env_from_slurm(_task_env(SLURM_JOB_ID=str(j)))["MASTER_PORT"])
             for j in (1, 9999, 10000, 4_294_967_295, int(JOB_ID))}
    assert len(ports) == 5 and all(20000 <= p <= 29999 for p in ports)
    assert distributed_env_from_slurm(_task_env()) == distributed_env_from_slurm(_task_env())


@pytest.mark.parametrize("env", [
    {},  # no SLURM
    _task_env(RANK="0", WORLD_SIZE="8"),  # torchrun already set the ranks
    {"SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NODELIST": "gpu[001-002]"},  # salloc shell, no task
    {k: v for k, v in _task_env().items() if k != "SLURM_JOB_NODELIST"},  # no node list
])
def test_no_slurm_task_env(env):
    assert distributed_env_from_slurm(env) == {}


# ---------------------------------------------------------------- fake SLURM commands

STUB = r"""#!/bin/bash
# Stand-in for the trainer / torchrun / srun: records its call, then exits as the test asks. The scripts'
# signal watcher (a job step that waits for SLURM's signal) ends at once.
case " $* " in *" --job-name=signal-watch "*) exit 0;; esac
name=$(basename "$0")
printf '%s\n' "$@" > "$REC/$name.args"
env > "$REC/$name.env"
echo $$ > "$REC/$name.pid"
finish() {
  [[ -z ${STUB_TOUCH_MARKER:-} ]] || touch "$ORYX_REQUEUE_MARKER"
  exit "${STUB_RC:-0}"
}
finish
"""

SCONTROL = r"""#!/bin/bash
echo "$*" >> "$REC/scontrol.calls"
if [[ $1 == show && $2 == hostnames ]]; then printf '%s\n' $FAKE_HOSTS; fi
"""



def _write_exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_slurm(tmp_path):
    """A job environment with fake scontrol/scancel/srun/torchrun on PATH; records under rec/."""
    bin_dir, rec, work = tmp_path / "bin", tmp_path / "rec", tmp_path / "work"
    for d in (bin_dir, rec, work / "logs"):
        d.mkdir(parents=True)
    for name in ("trainer", "torchrun", "srun"):
        _write_exe(bin_dir / name, STUB)
    _write_exe(bin_dir / "scontrol", SCONTROL)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "ORYX_", "STUB_", "MASTER_", "WORKERS", "MAX_REQUEUES", "TORCH_ELASTIC"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", REC=str(rec), SLURM_JOB_ID=JOB_ID,
               SLURM_GPUS_ON_NODE="4", SLURM_JOB_NUM_NODES="4", SLURM_CPUS_ON_NODE="96",
               SLURM_JOB_NODELIST="gpu[001-004]", FAKE_HOSTS="gpu001 gpu002 gpu003 gpu004")

    marker = work / "logs" / f".requeue-{JOB_ID}"

    def run(script, *overrides, **extra_env):
        return subprocess.run(["bash", str(SLURM_DIR / script), *overrides], cwd=work,
                              env={**env, **extra_env}, capture_output=True, text=True, timeout=20)

    def calls(name):
        path = rec / f"{name}.calls"
        return path.read_text().splitlines() if path.exists() else []

    def args(name):
        return (rec / f"{name}.args").read_text().splitlines()

    return SimpleNamespace(bin=bin_dir, rec=rec, work=work, env=env, marker=marker,
                           run=run, calls=calls, args=args)


OVERRIDES = ("recipe=oryx_tg_130m", "optimizer.lr=3e-3", "checkpoint.dir=/ckpt/run 1")


@pytest.mark.parametrize("script", ["train.sbatch", "train_multinode.sbatch"])
def test_sbatch_syntax_and_directives(script):
    path = SLURM_DIR / script
    subprocess.run(["bash", "-n", str(path)], check=True)
    directives = [line.split(None, 1)[1] for line in path.read_text().splitlines()
                  if line.startswith("#SBATCH")]
    for flag in ("--requeue", "--signal=B:USR1@180", "--output=logs/%x-%j.out", "--open-mode=append"):
        assert flag in directives
    assert not any("gpu" in d or "gres" in d for d in directives)  # a CPU partition refuses a GPU request


# ---------------------------------------------------------------- single node

def test_single_node_default_command(fake_slurm):
    result = fake_slurm.run("train.sbatch", *OVERRIDES)
    assert result.returncode == 0, result.stderr
    assert fake_slurm.args("torchrun") == [
        "--standalone", "--nnodes=1", "--nproc-per-node=4", "-m", "oryx_megatron.cli.train", *OVERRIDES]
    env = (fake_slurm.rec / "torchrun.env").read_text().splitlines()
    assert f"ORYX_REQUEUE_MARKER={fake_slurm.marker}" in env
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=150" in env
    assert fake_slurm.calls("scontrol") == []


@pytest.mark.parametrize("script", ["train.sbatch", "train_multinode.sbatch"])
@pytest.mark.parametrize("allocated, workers", [
    ({"SLURM_GPUS_ON_NODE": "4", "SLURM_NTASKS_PER_NODE": "1"}, 4),  # the GPUs on the node
    ({"SLURM_GPUS_ON_NODE": "0", "SLURM_NTASKS_PER_NODE": "2"}, 2),  # no GPUs: the tasks per node
    ({"SLURM_GPUS_ON_NODE": ""}, 1),  # neither
    ({"WORKERS": "3"}, 3),  # the knob
])
def test_workers_per_node(fake_slurm, script, allocated, workers):
    assert fake_slurm.run(script, **allocated).returncode == 0
    assert f"--nproc-per-node={workers}" in fake_slurm.args("srun" if "multinode" in script else "torchrun")


@pytest.mark.parametrize("stub_rc, marker, expect_rc, requeued", [
    (0, False, 0, False),
    (REQUEUE_EXIT_CODE, False, REQUEUE_EXIT_CODE, True),  # the trainer itself exited 3
    (1, True, REQUEUE_EXIT_CODE, True),  # torchrun exits 1; its workers left the marker
    (1, False, 1, False),  # a crash is not requeued
])
def test_single_node_exit_codes(fake_slurm, stub_rc, marker, expect_rc, requeued):
    fake_slurm.marker.touch()  # stale, from before an earlier requeue: must not count
    result = fake_slurm.run("train.sbatch", *OVERRIDES, ORYX_TRAIN_CMD=f"{fake_slurm.bin}/trainer --flag",
                            STUB_RC=str(stub_rc), STUB_TOUCH_MARKER="1" if marker else "")
    assert result.returncode == expect_rc, result.stderr
    assert fake_slurm.args("trainer") == ["--flag", *OVERRIDES]
    assert fake_slurm.calls("scontrol") == ([f"requeue {JOB_ID}"] if requeued else [])
    assert not fake_slurm.marker.exists()


def test_single_node_requeue_limit(fake_slurm):
    result = fake_slurm.run("train.sbatch", ORYX_TRAIN_CMD=f"{fake_slurm.bin}/trainer",
                            STUB_RC=str(REQUEUE_EXIT_CODE), SLURM_RESTART_COUNT="4", MAX_REQUEUES="4")
    assert result.returncode == REQUEUE_EXIT_CODE
    assert fake_slurm.calls("scontrol") == []
    assert "requeued 4 times" in result.stderr


def test_single_node_trainer_killed_by_signal(fake_slurm):
    # A SIGKILLed command (status 137) is reported as such and not requeued.
    killer = fake_slurm.bin / "killed"
    _write_exe(killer, "#!/bin/bash\nkill -KILL $$\n")
    result = fake_slurm.run("train.sbatch", ORYX_TRAIN_CMD=str(killer))
    assert result.returncode == 128 + signal.SIGKILL
    assert fake_slurm.calls("scontrol") == []


# ---------------------------------------------------------------- multi node

def test_multinode_rendezvous(fake_slurm):
    result = fake_slurm.run("train_multinode.sbatch", *OVERRIDES)
    assert result.returncode == 0, result.stderr
    port = 20000 + int(JOB_ID) % 10000
    assert fake_slurm.args("srun") == [
        "--nodes=4", "--ntasks=4", "--ntasks-per-node=1", "--cpus-per-task=96", "--kill-on-bad-exit=0",
        "torchrun", "--nnodes=4", "--nproc-per-node=4", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=gpu001:{port}", f"--rdzv-id={JOB_ID}", "-m", "oryx_megatron.cli.train", *OVERRIDES]
    assert fake_slurm.calls("scontrol") == ["show hostnames gpu[001-004]"]
    # MASTER_PORT is a knob, and the Python side derives the same default port.
    assert fake_slurm.run("train_multinode.sbatch", MASTER_PORT="29400").returncode == 0
    assert "--rdzv-endpoint=gpu001:29400" in fake_slurm.args("srun")
    assert launch.slurm_master_port(JOB_ID) == port


@pytest.mark.parametrize("marker, requeued", [(True, True), (False, False)])
def test_multinode_requeue_from_marker(fake_slurm, marker, requeued):
    # srun reports 1 when the torchruns fail; the workers' marker decides the requeue.
    result = fake_slurm.run("train_multinode.sbatch", STUB_RC="1", STUB_TOUCH_MARKER="1" if marker else "")
    assert result.returncode == (REQUEUE_EXIT_CODE if requeued else 1)
    assert (f"requeue {JOB_ID}" in fake_slurm.calls("scontrol")) == requeued


# ---------------------------------------------------------------- trainer side of the contract

def test_exit_for_requeue_touches_marker(tmp_path):
    marker = tmp_path / "logs" / "nested" / ".requeue-1"
    with pytest.raises(SystemExit) as exit_info:
        launch.exit_for_requeue({"ORYX_REQUEUE_MARKER": str(marker), "SLURM_JOB_ID": "1", "RANK": "0"})
    assert exit_info.value.code == REQUEUE_EXIT_CODE
    assert marker.exists()


@pytest.mark.parametrize("env, requeued", [
    ({"SLURM_JOB_ID": JOB_ID, "SLURM_PROCID": "0"}, True),  # submitit task 0
    ({"SLURM_JOB_ID": JOB_ID, "SLURM_PROCID": "0", "RANK": "3"}, False),  # RANK wins
    ({"SLURM_JOB_ID": JOB_ID, "SLURM_PROCID": "2"}, False),
    ({"RANK": "0"}, False),  # not a SLURM job
])
def test_request_requeue_without_sbatch_script(fake_slurm, monkeypatch, env, requeued):
    monkeypatch.setenv("PATH", fake_slurm.env["PATH"])
    monkeypatch.setenv("REC", str(fake_slurm.rec))
    launch.request_requeue(env)
    assert fake_slurm.calls("scontrol") == ([f"requeue {JOB_ID}"] if requeued else [])


# ---------------------------------------------------------------- Hydra launcher configs

@pytest.fixture
def compose_launcher(tmp_path):
    """Compose a minimal app whose search path holds recipes/, with a given hydra/launcher."""
    (tmp_path / "app.yaml").write_text(f"hydra:\n  searchpath:\n    - file://{RECIPES}\n")

    def run(launcher, *overrides):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
            return compose("app", overrides=[f"hydra/launcher={launcher}", f"hydra.sweep.dir={tmp_path}/sweep",
                                             *overrides], return_hydra_config=True)

    yield run
    GlobalHydra.instance().clear()


def test_slurm_launcher_config(compose_launcher):
    cfg = compose_launcher("slurm", "hydra.launcher.gpus_per_node=4", "hydra.launcher.signal_delay_s=300")
    launcher_cfg = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher_cfg["_target_"] == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert launcher_cfg["tasks_per_node"] == 4  # one task per GPU
    assert launcher_cfg["partition"] is None
    assert launcher_cfg["max_num_timeout"] == 0
    assert launcher_cfg["additional_parameters"] == {"signal": "USR1@300", "requeue": True}


def test_slurm_launcher_sbatch_directives(compose_launcher, fake_slurm, monkeypatch):
    """The job script submitit writes from slurm.yaml: USR1 to the tasks, requeueable, a task per GPU."""
    import submitit

    monkeypatch.setenv("PATH", fake_slurm.env["PATH"])  # submitit's SLURM executor looks for srun
    cfg = compose_launcher("slurm", "hydra.launcher.partition=gpu", "hydra.job.name=train")
    launcher = instantiate(cfg.hydra.launcher)
    launcher.setup(hydra_context=None, task_function=None, config=cfg)
    executors = []
    monkeypatch.setattr(submitit.AutoExecutor, "map_array", lambda self, *a: executors.append(self) or [])
    assert launcher.launch([["optimizer.lr=1e-3"]], initial_job_idx=0) == []
    text = executors[0]._executor._make_submission_file_text("python -m submitit.core._submit x", "uid")
    lines = set(text.splitlines())
    for line in ("--signal=USR1@180", "--requeue", "--gpus-per-node=8", "--ntasks-per-node=8",
                 "--nodes=1", "--partition=gpu", "--time=1440", "--cpus-per-task=8"):
        assert f"#SBATCH {line}" in lines, text
    assert not any("USR2" in line for line in lines)


def test_local_launcher_config(compose_launcher):
    cfg = compose_launcher("local")
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ == "LocalLauncher"
    assert (launcher.params["tasks_per_node"], launcher.params["gpus_per_node"]) == (1, 1)


def test_train_app_composes_with_slurm_launcher():
    import oryx_megatron.run_config  # noqa: F401  (registers the train schema, as oryx-train does)

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
            cfg = compose("train", overrides=["recipe=oryx_tg_130m", "hydra/launcher=slurm"],
                          return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert cfg.hydra.launcher.tasks_per_node == cfg.hydra.launcher.gpus_per_node


def test_slurm_cpu_launcher_config(compose_launcher):
    """hydra/launcher=slurm_cpu: the slurm launcher with one task and no GPU request (a CPU partition)."""
    cfg = OmegaConf.to_container(compose_launcher("slurm_cpu").hydra.launcher, resolve=True)
    assert (cfg["gpus_per_node"], cfg["tasks_per_node"], cfg["cpus_per_task"]) == (0, 1, 1)
    assert cfg["additional_parameters"] == {"signal": "USR1@180", "requeue": True}


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (RECIPES / "recipe").glob("*.yaml")))
def test_platform_cpu_switches_off_gpu_settings(recipe):
    """platform=cpu over every recipe: fp32, megatron's local layers, a small step; the model as the recipe has it."""
    import oryx_megatron.run_config  # noqa: F401  (registers the train schema)
    from oryx_megatron.run_config import load_train_config

    def compose_run(*overrides):
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
                cfg = compose("train", overrides=[f"recipe={recipe}", "data.data_path=[x]", "checkpoint.dir=x",
                                                  *overrides])
        finally:
            GlobalHydra.instance().clear()
        return load_train_config(cfg)

    gpu, cpu = compose_run(), compose_run("platform=cpu")
    assert gpu.train.bf16 and not cpu.train.bf16
    assert cpu.model.transformer_impl == "local"
    assert (cpu.train.micro_batch_size, cpu.train.global_batch_size, cpu.data.seq_length) == (1, 2, 256)
    assert cpu.model == gpu.model or cpu.model.transformer_impl != gpu.model.transformer_impl
