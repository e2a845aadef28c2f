"""launch/: the scripts parse, say what they run and how to change node/GPU counts, the
tutorial configs load in minizero and in DeepSpeed, and the SLURM scripts build the right
command lines and hostfile, passing the config as it is (run against fake `scontrol`/`srun`/`deepspeed`)."""
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import pytest

from minizero.config import load_config

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"
SCRIPTS = ["train_laptop.sh", "slurm_minizero.sbatch", "slurm_deepspeed.sbatch", "slurm_torch.sbatch", "gpu_check.sh",
           "gpu_lease.sh"]
CONFIGS = ["ds_config_basic.json", "ds_config_step4.json", "ds_config_step5.json"]
NODES = ["gpu-a01", "gpu-a02"]


def header(path: Path) -> str:
    """The leading comment block (after a shebang), without '#SBATCH' directives."""
    lines = []
    for line in path.read_text().splitlines():
        if line.startswith("#!") and not lines:
            continue
        if not line.startswith("#"):
            break
        if not line.startswith("#SBATCH"):
            lines.append(line.lstrip("#").strip())
    return "\n".join(lines)


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_parses(name):
    r = subprocess.run(["bash", "-n", str(LAUNCH / name)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("name", SCRIPTS + ["hostfile.example"])
def test_header_says_what_and_how_to_scale(name):
    text = header(LAUNCH / name)
    assert len(text.splitlines()) >= 4, f"{name}: no comment header"
    assert re.search(r"what it (runs|is for)", text, re.I), f"{name}: header does not say what it runs"
    assert re.search(r"node.*gpu count|number of (nodes|processes)", text, re.I | re.S), \
        f"{name}: header does not say how to change node/GPU counts"


def test_sbatch_directives_match_header_defaults():
    for name in ("slurm_minizero.sbatch", "slurm_deepspeed.sbatch", "slurm_torch.sbatch"):
        text = (LAUNCH / name).read_text()
        assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=4" in text
        assert "GPUS_PER_NODE=${GPUS_PER_NODE:-4}" in text
        # directives must come before the first command, or sbatch ignores them
        first_cmd = next(i for i, l in enumerate(text.splitlines()) if l and not l.startswith("#"))
        assert all(i < first_cmd for i, l in enumerate(text.splitlines()) if l.startswith("#SBATCH"))


# ----------------------------------------------------------------------------- configs

@pytest.fixture
def ds_parse(monkeypatch):
    """DeepSpeedConfig as if in a world of `world_size` ranks, no process group needed
    (the same stub as tests/agreement/test_config.py: DeepSpeedConfig asks deepspeed.comm for both)."""
    pytest.importorskip("deepspeed")
    import deepspeed.runtime.config as ds_config_mod

    def parse(config, world_size):
        monkeypatch.setattr(ds_config_mod, "dist", types.SimpleNamespace(
            get_rank=lambda: 0, get_world_size=lambda *a, **k: world_size))
        return ds_config_mod.DeepSpeedConfig(config)
    return parse


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_configs_fit_any_world_in_both(ds_parse, name, world_size):
    """The tutorial's configs set the micro-batch (and step 5 the accumulation), never
    train_batch_size: the batch is micro x accumulation x ranks, so 1, 2, 4 and 8 ranks
    (the sbatch scripts' 2 x 4) all load them as they are, in both libraries alike."""
    path = LAUNCH / name
    assert "train_batch_size" not in json.loads(path.read_text())
    ours, ds = load_config(path, world_size=world_size), ds_parse(str(path), world_size)
    assert (ours.train_batch_size, ours.train_micro_batch_size_per_gpu, ours.gradient_accumulation_steps) == \
        (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps)
    assert ours.train_batch_size == ours.train_micro_batch_size_per_gpu * ours.gradient_accumulation_steps * world_size
    assert ours.zero.stage == ds.zero_optimization_stage


# ----------------------------------------------------------------------------- SLURM scripts, faked

def fake_bin(tmp_path: Path) -> Path:
    """scontrol prints the node names; srun/deepspeed record their arguments, one per line."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    scripts = {
        "scontrol": f'[ "$1 $2" = "show hostnames" ] || exit 1\nprintf "%s\\n" {" ".join(NODES)}\n',
        "srun": 'printf "%s\\n" "$@" > "$FAKE_LOG"; printf "%s\\n" "$@" --- >> "$FAKE_LOG.all"\n',
        "deepspeed": 'printf "%s\\n" "$@" > "$FAKE_LOG"\n',
    }
    for name, body in scripts.items():
        p = bindir / name
        p.write_text("#!/bin/bash\n" + body)
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return bindir


def run_sbatch(name, tmp_path, extra_env=None):
    # A job starts with a clean environment: drop any rendezvous variables an earlier test
    # in this process exported (a 1-rank gloo group sets MASTER_ADDR/MASTER_PORT).
    # CONFIG and MODEL too: the scripts read them.
    base = {k: v for k, v in os.environ.items()
            if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "CONFIG", "MODEL")}
    env = dict(base, PATH=f"{fake_bin(tmp_path)}:{Path(sys.executable).parent}:{os.environ['PATH']}",
               SLURM_JOB_NODELIST="gpu-a[01-02]", SLURM_NNODES="2", SLURM_JOB_ID="4242",
               SLURM_SUBMIT_DIR=str(ROOT), FAKE_LOG=str(tmp_path / "argv"),
               HOSTFILE=str(tmp_path / "hostfile"), **(extra_env or {}))
    r = subprocess.run(["bash", str(LAUNCH / name), "--max-steps", "5"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return (tmp_path / "argv").read_text().splitlines()


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_slurm_minizero_command(tmp_path, ds_parse):
    argv = run_sbatch("slurm_minizero.sbatch", tmp_path)
    assert argv[:6] == ["--nodes", "2", "--ntasks-per-node", "1", "--cpus-per-task", "32"] and argv[6] == "torchrun"
    assert flag(argv, "--nnodes") == "2" and flag(argv, "--nproc-per-node") == "4"
    assert flag(argv, "--rdzv-backend") == "c10d" and flag(argv, "--rdzv-id") == "4242"
    assert flag(argv, "--rdzv-endpoint") == f"{NODES[0]}:{20000 + 4242}"   # a port per job id
    assert flag(argv, "-m") == "minizero.train" and argv[-2:] == ["--max-steps", "5"]
    assert flag(argv, "--model") == "tutorial"
    # the tutorial's config itself, as it is: 8 ranks x micro-batch 8 = 64 in both libraries
    cfg = flag(argv, "--config")
    assert cfg == "launch/ds_config_basic.json"
    ours, ds = load_config(ROOT / cfg, world_size=8), ds_parse(str(ROOT / cfg), 8)
    assert ours.train_batch_size == ds.train_batch_size == 64
    assert ours.gradient_accumulation_steps == ds.gradient_accumulation_steps == 1


def test_slurm_minizero_runs_the_preflight_first_on_the_jobs_own_line(tmp_path):
    """The first srun is the job's line under `python3 -m minizero.preflight` (its own
    rendezvous id), the second the job; PREFLIGHT=0 leaves only the job."""
    job = run_sbatch("slurm_minizero.sbatch", tmp_path)
    calls = (tmp_path / "argv.all").read_text().split("---\n")[:-1]
    pre, last = (c.splitlines() for c in calls)
    assert last == job and len(calls) == 2
    at = pre.index("torchrun")
    assert pre[at - 4:at] == ["python3", "-m", "minizero.preflight", "--timeout"] or \
        pre[at - 5:at - 2] == ["python3", "-m", "minizero.preflight"], pre
    strip = lambda argv: [a for a in argv if a not in ("--rdzv-id",) and not a.endswith("4242")]
    assert strip(pre[at:]) == strip(job[job.index("torchrun"):])   # the same torchrun line, the same program
    assert flag(pre, "--rdzv-id") == "preflight-4242" and flag(job, "--rdzv-id") == "4242"
    (tmp_path / "off").mkdir()
    run_sbatch("slurm_minizero.sbatch", tmp_path / "off", {"PREFLIGHT": "0"})
    assert (tmp_path / "off" / "argv.all").read_text().count("---") == 1


def test_slurm_torch_command(tmp_path):
    """The PyTorch reference: slurm_minizero.sbatch's launch, reference/torch_train.py, STAGE (default 3)."""
    argv = run_sbatch("slurm_torch.sbatch", tmp_path)
    assert argv[:6] == ["--nodes", "2", "--ntasks-per-node", "1", "--cpus-per-task", "32"] and argv[6] == "torchrun"
    assert flag(argv, "--nproc-per-node") == "4" and flag(argv, "--rdzv-endpoint") == f"{NODES[0]}:{20000 + 4242}"
    assert "reference/torch_train.py" in argv and flag(argv, "--stage") == "3"
    assert flag(argv, "--config") == "launch/ds_config_basic.json" and argv[-2:] == ["--max-steps", "5"]
    (tmp_path / "s0").mkdir()
    assert flag(run_sbatch("slurm_torch.sbatch", tmp_path / "s0", {"STAGE": "0"}), "--stage") == "0"


def test_slurm_scripts_take_config_and_model(tmp_path):
    """Step 5 on the cluster: CONFIG and MODEL reach both scripts' command lines."""
    env = {"CONFIG": "launch/ds_config_step5.json", "MODEL": "tutorial-24"}
    for name, config_flag in (("slurm_minizero.sbatch", "--config"), ("slurm_deepspeed.sbatch", "--deepspeed_config")):
        (tmp_path / name).mkdir()
        argv = run_sbatch(name, tmp_path / name, env)
        assert flag(argv, config_flag) == env["CONFIG"] and flag(argv, "--model") == env["MODEL"]


def test_slurm_deepspeed_hostfile_and_command(tmp_path, ds_parse):
    argv = run_sbatch("slurm_deepspeed.sbatch", tmp_path)
    hostfile = (tmp_path / "hostfile").read_text()
    assert hostfile == "".join(f"{n} slots=4\n" for n in NODES)
    assert flag(argv, "--hostfile") == str(tmp_path / "hostfile")
    assert flag(argv, "--num_nodes") == "2" and flag(argv, "--num_gpus") == "4"
    assert flag(argv, "--master_addr") == NODES[0]
    assert "reference/train.py" in argv and argv[-2:] == ["--max-steps", "5"]
    cfg = flag(argv, "--deepspeed_config")
    assert cfg == "launch/ds_config_basic.json"
    assert ds_parse(str(ROOT / cfg), 8).train_batch_size == load_config(ROOT / cfg, world_size=8).train_batch_size == 64
    # DeepSpeed's own hostfile parser accepts the generated file and the example
    from deepspeed.launcher.runner import _parse_hostfile
    assert _parse_hostfile(hostfile.splitlines()) == {n: 4 for n in NODES}
    example = _parse_hostfile((LAUNCH / "hostfile.example").read_text().splitlines())
    assert list(example.values()) == [4, 4]


def test_laptop_script_uses_torchrun_standalone():
    text = (LAUNCH / "train_laptop.sh").read_text()
    assert "torchrun --standalone" in text and "-m minizero.train" in text and "reference/train.py" in text
    assert '--stage "$STAGE"' in text and "STAGE=${STAGE:-3}" in text and "--dataset synthetic" in text


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
@pytest.mark.parametrize("name", SCRIPTS)
def test_shellcheck(name):
    r = subprocess.run(["shellcheck", "-S", "warning", str(LAUNCH / name)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


@pytest.fixture(scope="module")
def lease(tmp_path_factory):
    """One run of launch/gpu_lease.sh on this machine without a GPU, parts `env bogus`, with a
    carried wheel whose module stands in for deepspeed (the two tests below read it: each
    lease run imports torch in its env part). Returns (the run, OUT, its TMPDIR)."""
    tmp_path = tmp_path_factory.mktemp("lease")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "deepspeed", "raise ImportError('the carried stand-in for deepspeed was imported')\n")
    out, scratch = tmp_path / "out", tmp_path / "tmp"
    scratch.mkdir()
    r = subprocess.run(["bash", str(LAUNCH / "gpu_lease.sh"), str(out), "env", "bogus"], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable,
                                                    "GPU_LEASE_WHEELS": str(wheels), "TMPDIR": str(scratch)})
    return r, out, scratch


def test_gpu_lease_runs_its_parts_in_order_and_names_an_unknown_one(lease):
    """launch/gpu_lease.sh on a machine without a GPU: the env part still writes env.txt (what
    the box has, or why not), an unknown part is named in one line and skipped, and every part
    leaves its line in parts.log, in the order asked (the wheels part first, always: here it
    installs the carried wheel and says so in the line before its own)."""
    r, out, _ = lease
    log = (out / "parts.log").read_text().splitlines()
    env_rc = int(re.search(r" env: exit (\d+) ", log[2]).group(1))
    assert r.returncode == max(2, env_rc), r.stderr   # a part asked for and not run: a usage error (2)
    assert len(log) == 5 and "wheels: installed 1 from " in log[0] and " wheels: exit 0 " in log[1] \
        and "unknown part bogus" in log[3] and log[4].endswith(f"worst exit status: {max(2, env_rc)}"), log
    assert "budget 25 s" in log[2]
    assert "torch.distributed.set_timeout: " in (out / "env.txt").read_text()
    assert r.stderr == ""


def test_gpu_lease_exits_with_its_worst_parts_status(tmp_path):
    """A part whose command fails makes the whole lease fail with that status (before, the
    script ended in `exit 0` whatever its parts did): here the env part's Python is `false`."""
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(LAUNCH / "gpu_lease.sh"), str(out), "env"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHON": "false", "GPU_LEASE_WHEELS": str(tmp_path / "none")})
    log = (out / "parts.log").read_text().splitlines()
    assert r.returncode == 1, (r.returncode, log)
    assert " wheels: exit 0 " in log[0] and " env: exit 1 in " in log[1] and log[-1].endswith("worst exit status: 1")


def test_gpu_lease_plan_shows_the_nccl_checks_offload_case_offloading():
    """`--dry-run nccl` builds each nccl_ws1 case's engine on the CPU and says where its
    parameters live: the offload case keeps every parameter shard in host memory."""
    r = subprocess.run(["bash", str(LAUNCH / "gpu_lease.sh"), "--dry-run", "nccl"], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "z3-bf16-offload: 28,224 of 28,224 parameter bytes in host memory; 3 of 3 FlatParams partitioned " \
           "(offloads)" in r.stdout, r.stdout


def test_gpu_lease_plan_fits_eight_minutes_and_starts_python_as_python3():
    """--plan (or --dry-run) on any machine: each part with its time budget and its commands;
    the budgets add up to at most 8 minutes; every Python it starts is python3 (the lent image
    may have no `python`), and so is every other launch script's."""
    for flag in ("--plan", "--dry-run"):
        r = subprocess.run(["bash", str(LAUNCH / "gpu_lease.sh"), flag], capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if k != "PYTHON"})
        assert r.returncode == 0 and r.stderr == "", r.stderr
        parts = re.findall(r"^  (\w+)\s+(\d+) s$", r.stdout, re.M)
        assert [p for p, _ in parts] == ["wheels", "env", "nccl", "preflight", "readme", "regress", "full", "ds"]
        assert sum(int(b) for _, b in parts) <= 480
        assert f"{sum(int(b) for _, b in parts)} s of a 480 s limit" in r.stdout
        commands = re.findall(r"^\s+\$ (.*)$", r.stdout, re.M)
        assert len(commands) >= len(parts)
        assert not [c for c in commands if re.match(r"(python|torchrun)\b", c.split()[0])], commands
        assert any("--nproc-per-node 1 launch/nccl_ws1.py" in c for c in commands)
        assert any("-m minizero.train --stage 3" in c and "--save-every 100" in c for c in commands)
        assert any("--resume" in c and "--max-steps 200" in c for c in commands)
    documented = re.findall(r"^\| `(\w+)` \| (\d+) \|", (ROOT / "docs" / "gpu.md").read_text(), re.M)
    extra = re.findall(r"^  (\w+)\s+(\d+) s$", subprocess.run(
        ["bash", str(LAUNCH / "gpu_lease.sh"), "--plan", "memory", "fp16"], capture_output=True, text=True,
        timeout=60).stdout, re.M)[1:]   # the wheels part comes first always
    assert documented == parts + extra, "docs/gpu.md's lease table and the script's budgets differ"
    bare = re.compile(r"(^|[\s;&|(=-])python([\s;&|)}]|$)")   # `python x`, PY=python, ${PYTHON:-python}
    for path in sorted(LAUNCH.glob("*.sh")) + sorted(LAUNCH.glob("*.sbatch")):
        code = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith(("#", "echo "))]
        assert not [ln for ln in code if bare.search(ln)], path.name


def _wheel(folder, name: str, source: str):
    """A minimal pure-Python wheel holding module `name` (what pip --no-index installs)."""
    import base64
    import hashlib
    import zipfile
    dist = f"{name}-1.0.dist-info"
    files = {f"{name}.py": source, f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
             f"{dist}/top_level.txt": f"{name}\n"}
    record = [f"{k},sha256={base64.urlsafe_b64encode(hashlib.sha256(v.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(v.encode())}" for k, v in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return path


def test_gpu_lease_installs_carried_wheels_onto_every_parts_path(lease):
    """Wheels in GPU_LEASE_WHEELS (.whl/ by default: how DeepSpeed reaches a box with no
    network) are installed before the parts and are importable in them: here a wheel whose
    module stands in for deepspeed, which the env part imports and reports. Its work folder
    (the installed wheels, the logs) is gone afterwards: what is kept is in OUT."""
    r, out, scratch = lease
    log = (out / "parts.log").read_text().splitlines()
    assert log[-1].endswith(f"worst exit status: {r.returncode}"), (log, r.stderr)
    assert "wheels: installed 1 from " in log[0] and " wheels: exit 0 " in log[1] and " env: exit " in log[2], log
    assert "the carried stand-in for deepspeed was imported" in (out / "env.txt").read_text()
    with tarfile.open(out / "logs.tgz") as tgz:   # the logs, not the installed packages' own .txt files
        assert not [n for n in tgz.getnames() if "site" in n.split("/")], tgz.getnames()
    assert list(scratch.iterdir()) == []
