import subprocess


def test_srun_hostname():
    out = subprocess.run(["srun", "-N1", "hostname"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
