"""Loading a checkpoint never runs code; saving one makes it durable (checkpoint_files/safe_load.py,
durable.py).

A planted file: one object whose unpickling runs `touch MARKER` (what `os.system` in a
`__reduce__` does: issue 53's attack). Every reader of minizero's folders refuses it in one
line naming the file and the global, before anything of it runs: the marker never appears,
and nothing is written. Then: a client_state that is not plain data is refused at save, and
every file of a save is fsynced before it is published (the recording wrapper below).
DeepSpeed's files: tests/agreement/test_checkpoint_deepspeed.py; the data folder:
tests/tools/test_data_safe_load.py; `latest` on a lagging node: tests/tools/test_shared_folder_lag.py.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from minizero.checkpoint_files.checkpoint_folder import CheckpointError
from tests.support.command_runs import run_command

SMALL = ["--synthetic-train", "64", "--synthetic-test", "8", "--num-samples", "0"]
MODEL_FILE, OPTIM0, RNG0 = "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng_rank_0.pt"


class PlantedCall:
    """Unpickled, it runs `touch MARKER`: the object an attacker adds to a checkpoint."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant(path, marker, protocol: int = 2) -> None:
    """Add a PlantedCall to a checkpoint file (read here with weights_only=False: the test's own
    file). Protocol 2 names os.system with GLOBAL (as torch.save writes), 4 with STACK_GLOBAL."""
    sd = torch.load(path, map_location="cpu", weights_only=False)
    sd["planted"] = PlantedCall(marker)
    torch.save(sd, path, pickle_protocol=protocol)


def refused_line(path) -> str:
    return f"{path}: refused to load: unpickling it would call posix.system (os.system); a checkpoint holds"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The issue's first command: `python -m minizero.train --stage 1 --max-steps 2 --save-every 2
    --save-dir run` (on small synthetic data)."""
    d = tmp_path_factory.mktemp("attack") / "run"
    p = run_command("minizero.train", ["--stage", "1", "--max-steps", "2", "--save-every", "2",
                                       "--save-dir", str(d), *SMALL])
    assert p.returncode == 0, p.stderr[-2000:]
    return d


def test_the_attack_on_resume_is_one_line_and_runs_nothing(run, tmp_path):
    """Issue 53's attack, repeated: an os.system object planted in the model-states file, then
    `python -m minizero.train --stage 1 --max-steps 3 --resume run --save-dir run2`. Before:
    the command ran and the resume finished with no word."""
    planted, marker = tmp_path / "run", tmp_path / "marker"
    shutil.copytree(run, planted)
    victim = planted / "global_step2" / MODEL_FILE
    plant(victim, marker)
    p = run_command("minizero.train", ["--stage", "1", "--max-steps", "3", "--resume", str(planted),
                                       "--save-dir", str(tmp_path / "run2"), *SMALL])
    assert not marker.exists()
    assert p.returncode != 0
    assert p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(f"python -m minizero.train: error: {refused_line(victim)}"), p.stderr
    assert not (tmp_path / "run2").exists()


def _load_into_an_engine(folder):
    from tests.tools.test_checkpoint_io import checkpoint_engine
    engine = checkpoint_engine(1, "fp32", preset="tiny")
    try:
        engine.load_checkpoint(str(folder))
    except CheckpointError as e:
        return str(e)
    return None


@pytest.mark.parametrize("victim,protocol", [(MODEL_FILE, 2), (OPTIM0, 4), (RNG0, 2)])
def test_every_reader_refuses_a_planted_file_before_it_runs(run, tmp_path, capsys, victim, protocol):
    """engine.load_checkpoint and the three commands that read a checkpoint, on a file planted
    in each kind of file (in the optimizer file with STACK_GLOBAL, which torch's safe unpickler
    refuses as an opcode: the line still names the global, read from the opcodes): one line
    naming the file and os.system, the marker never made, no output written."""
    from minizero.checkpoint_files import export_deepspeed, reshard, zero_to_fp32
    planted, marker = tmp_path / "run", tmp_path / "marker"
    shutil.copytree(run, planted)
    path = planted / "global_step2" / victim
    plant(path, marker, protocol)
    said = _load_into_an_engine(planted)
    assert said is not None and said.startswith(refused_line(path)) and "\n" not in said, said
    for prog, main, argv in (("minizero.reshard", reshard.main, [str(tmp_path / "out"), "--world-size", "2"]),
                             ("minizero.zero_to_fp32", zero_to_fp32.main, [str(tmp_path / "out.pt")]),
                             ("minizero.export_deepspeed", export_deepspeed.main, [str(tmp_path / "out")])):
        assert main([str(planted), *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"python -m {prog}: error: {refused_line(path)}"), err
        assert not os.path.exists(argv[0]), prog
    assert not marker.exists()


# ----------------------------------------------------------------------------- what a save writes

def test_a_client_state_that_is_not_plain_data_is_refused_before_anything_is_written(tmp_path):
    """weights_only=True loads tensors and plain data; a save writes nothing else. Refused,
    not converted: a converted entry would come back as another type than the one saved."""
    import collections

    import numpy as np

    from tests.tools.test_checkpoint_io import checkpoint_engine
    engine = checkpoint_engine(1, "fp32")
    Point = collections.namedtuple("Point", "x y")
    for bad, named in (({"data": {"mean": np.zeros(3)}}, "client_state['data']['mean'] is a numpy.ndarray"),
                       ({"p": Point(1, 2)}, "client_state['p'] is a tests.tools.test_checkpoint_safe_load.Point"),
                       ({"n": np.float64(1.0)}, "client_state['n'] is a numpy.float64")):
        with pytest.raises(CheckpointError) as e:
            engine.save_checkpoint(str(tmp_path / "d"), client_state=bad)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"refusing to save checkpoint global_step0: {named}"), msg
        assert msg.endswith("; nothing was written") and not (tmp_path / "d").exists()
    plain = {"step": 3, "rows": [{"loss": 1.5, "ok": True}], "pair": (1, "a"), "rng": torch.get_rng_state(),
             "none": None, "dtype": torch.bfloat16, "size": torch.Size([2, 3])}
    engine.save_checkpoint(str(tmp_path / "d"), client_state=plain)
    _, back = engine.load_checkpoint(str(tmp_path / "d"))
    assert back.keys() == plain.keys() and all(
        torch.equal(back[k], v) if torch.is_tensor(v) else back[k] == v and type(back[k]) is type(v)
        for k, v in plain.items())
    # a numpy number in the config is minizero's record of that number: saved as the Python number
    from tests.tools.test_checkpoint_io import checkpoint_config
    cfg = checkpoint_config(1, "fp32")
    cfg["optimizer"]["params"]["lr"] = np.float64(1e-3)
    checkpoint_engine(1, "fp32", config=cfg).save_checkpoint(str(tmp_path / "e"))
    meta = torch.load(str(tmp_path / "e" / "global_step0" / MODEL_FILE), weights_only=True)
    lr = meta["config"]["optimizer"]["params"]["lr"]
    assert type(lr) is float and lr == 1e-3


class _Recorder:
    """Stands in for os.fsync and os.replace, and notes each call (the path an fsync'd file
    descriptor names) in order."""

    def __init__(self, monkeypatch):
        self.events, self.fsync, self.replace = [], os.fsync, os.replace
        monkeypatch.setattr(os, "fsync", self._fsync)
        monkeypatch.setattr(os, "replace", self._replace)

    def _fsync(self, fd):
        self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return self.fsync(fd)

    def _replace(self, src, dst, **k):
        self.events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
        return self.replace(src, dst, **k)

    def at(self, *event) -> int:
        return self.events.index(event)

    def synced(self, path) -> int:
        return self.at("fsync", os.path.realpath(path))


def test_a_save_fsyncs_every_file_and_folder_before_publishing_and_latest_after(tmp_path, monkeypatch):
    """Issue 52, 3: each file and `<tag>.tmp` fsynced before the publish, the save folder after
    the rename, `latest` written as temp file, fsync, rename, fsync of the folder. Before, a
    save made no fsync at all, and `latest` could name truncated files after a power cut."""
    from tests.tools.test_checkpoint_io import _one_step, checkpoint_engine
    engine = checkpoint_engine(1, "fp32")
    _one_step(engine, 0)
    d = os.path.realpath(tmp_path / "d")
    rec = _Recorder(monkeypatch)
    engine.save_checkpoint(d)
    final, tmp, latest = os.path.join(d, "global_step1"), os.path.join(d, "global_step1.tmp"), os.path.join(d, "latest")
    publish = rec.at("replace", tmp, final)
    names = os.listdir(final)
    assert set(names) == {MODEL_FILE, RNG0, OPTIM0}
    assert all(rec.synced(os.path.join(tmp, n)) < rec.synced(tmp) < publish for n in names)
    folder_after = [i for i, e in enumerate(rec.events) if e == ("fsync", d) and i > publish]
    latest_at = rec.at("replace", latest + ".tmp", latest)
    assert folder_after and folder_after[0] < latest_at                 # the rename is on disk before `latest`
    assert rec.synced(latest + ".tmp") < latest_at < folder_after[-1]    # and `latest` itself, then its folder
    # the commands that write a checkpoint do the same: each file, then `latest`
    from minizero.checkpoint_files import export_deepspeed, reshard
    for name, main, extra in (("resharded", reshard.main, ["--world-size", "2"]), ("exported", export_deepspeed.main, [])):
        out = os.path.join(os.path.realpath(tmp_path), name)
        rec.events.clear()
        assert main([d, out, *extra]) == 0
        latest_at = rec.at("replace", os.path.join(out, "latest.tmp"), os.path.join(out, "latest"))
        for n in os.listdir(os.path.join(out, "global_step1")):
            assert rec.synced(os.path.join(out, "global_step1.tmp", n)) < latest_at, (name, n)
        assert rec.synced(out) < latest_at


def test_an_export_pickled_in_the_older_form_still_loads(run, tmp_path, monkeypatch):
    """`python -m minizero.export_deepspeed` writes DeepSpeed's loss scaler as DeepSpeed does
    (protocol 2's NEWOBJ: the file names DeepSpeed's class and nothing else). Folders it wrote
    before pickled it through copyreg._reconstructor and builtins.object; the reader allows
    exactly that form of it, building a stand-in and nothing else."""
    import copyreg

    from minizero.checkpoint_files.deepspeed_pickle import Foreign, torch_load
    from minizero.checkpoint_files.export_deepspeed import main
    from minizero.checkpoint_files.safe_load import offending_global
    monkeypatch.setattr(Foreign, "__reduce_ex__",
                        lambda self, protocol: (copyreg._reconstructor, (type(self), object, None), dict(self.__dict__)))
    assert main([str(run), str(tmp_path / "old")]) == 0
    optim = str(tmp_path / "old" / "global_step2" / OPTIM0)
    assert offending_global(optim, {"deepspeed.runtime.fp16.loss_scaler.LossScaler"}) == "copyreg._reconstructor"
    scaler = torch_load(optim)["optimizer_state_dict"]["loss_scaler"]
    assert (type(scaler).__name__, scaler.cur_scale, scaler.dynamic) == ("LossScaler", 1.0, False)
    # and DeepSpeed's own trainer resumes it, its loads weights-only (reference/train.py)
    p = run_command("reference/train.py", ["--stage", "1", "--max-steps", "3", "--resume", str(tmp_path / "old"),
                                           "--save-dir", str(tmp_path / "resumed"), *SMALL])
    assert p.returncode == 0 and "deepspeed: resumed from" in p.stdout + p.stderr, p.stderr[-3000:]
