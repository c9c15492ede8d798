"""Sharded runs (`--workers N`, `ptq.parallel.workers`) give the one-process result bit for bit: tables, skipped
images, reports; a worker that dies has its shard re-run."""
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from ptq.calibration.shards import CalibrationJob
from ptq.cli import main
from ptq.data.images import ImageLog, Preprocess
from ptq.parallel.workers import LocalPool, optimistic_used, plan_shards, run_sharded
from ptq.data.samples import ImageFormat
from tiny_models import write_tiny_case

RAW_FLAGS = ["--mean", "0", "--std", "255", "--crop-ratio", "1", "-q"]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def calibrate_cli(model, images, out, *flags) -> Path:
    assert main(["calibrate", str(model), "--images", str(images), "--out", str(out), "-q", *flags]) == 0
    return out / f"{Path(model).stem}.quant.json"


def test_plan_is_whole_batches_in_order_with_the_isolated_prefix():
    used = [Path(f"{k}.jpg") for k in range(11)]
    shards = plan_shards(used, batch_size=3, shard_batches=2, isolated=4)
    assert [s.start for s in shards] == [0, 6]
    assert [[len(b) for b in s.batches] for s in shards] == [[3, 3], [3, 2]]
    assert [p for s in shards for b in s.batches for p in b] == used
    assert [s.isolated for s in shards] == [4, 0]
    assert optimistic_used(used, {used[1]: "bad", used[4]: "bad"}, limit=4) == [used[0], used[2], used[3], used[5]]


def test_guided_shards_shrink_to_one_batch_and_keep_their_images_when_the_plan_changes_further_on():
    from ptq.parallel.workers import guided_shard_batches

    sizes = guided_shard_batches(200, 1, 2)
    assert sum(sizes) == 200 and sizes[0] == 50 and sizes[-3:] == [1, 1, 1]
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))
    assert guided_shard_batches(10, 4, 1) == [2, 1] and guided_shard_batches(0, 1, 2) == [1]
    used = [Path(f"{k}.jpg") for k in range(20)]
    shards = plan_shards(used, batch_size=2, shard_batches=guided_shard_batches(20, 2, 2), isolated=5)
    assert [len(s.batches) for s in shards] == [3, 2, 2, 1, 1, 1] and [s.isolated for s in shards] == [5, 0, 0, 0, 0, 0]
    assert [p for s in shards for b in s.batches for p in b] == used
    replanned = plan_shards(used[:13] + used[14:], 2, guided_shard_batches(20, 2, 2), isolated=5)
    assert replanned[:2] == shards[:2] and replanned[2] != shards[2]  # the shards before image 13 are kept
    assert [s.start for s in replanned] == [0, 6, 10, 14, 16, 18] and replanned[-1].images == 1  # the last size repeats


@pytest.mark.parametrize("calibrator", ["mean", "3std"])
def test_bundled_photos_two_workers_write_the_one_process_table(model_path, calib_dir, tmp_path, calibrator):
    """The order-sensitive calibrators: per-batch extrema (mean) and Chan moments (3std); 3 shards of batch 4
    over 12 sampled images of examples/calib."""
    flags = ["--calibrator", calibrator, "--batch-size", "4", "--num-images", "12", "--seed", "3"]
    one = calibrate_cli(model_path, calib_dir, tmp_path / "w1", *flags)
    two = calibrate_cli(model_path, calib_dir, tmp_path / "w2", *flags, "--workers", "2")
    assert digest(one) == digest(two)
    assert digest(one.with_name("efficientnet_lite0.qdq.onnx")) == digest(two.with_name("efficientnet_lite0.qdq.onnx"))


@pytest.fixture()
def tiny_with_bad_files(tmp_path):
    """A dynamic-batch model and 14 lossless 8x8 images with two undecodable ones among them."""
    model, images, _ = write_tiny_case(tmp_path, 14)
    names = sorted(p.name for p in images.iterdir())
    (images / (names[2][:-4] + "a.png")).write_bytes(b"\x89PNG garbage")  # sorts right after the third image
    (images / "zz_broken.png").write_bytes(b"\x89PNG more garbage")
    return model, images


@pytest.mark.parametrize("limit", [None, 9])
def test_unreadable_images_skipped_and_counted_as_in_one_process(tiny_with_bad_files, limit):
    """A bad file inside a shard shifts every later batch: the driver re-plans and re-runs those shards."""
    from ptq.calibration.pipeline import calibrate

    model, images = tiny_with_bad_files
    results = [calibrate(model, images, None, calibrator="mean", batch_size=3, num_images=limit, seed=1,
                         preprocess=Preprocess(mean=0, std=255, crop_ratio=1.0), workers=workers, write_qdq=False)
               for workers in (1, 3)]
    one, three = results
    assert json.dumps(one.table.to_dict()) == json.dumps(three.table.to_dict())
    assert three.images_used == (14 if limit is None else limit)
    assert three.skipped == one.skipped and one.images_used == three.images_used
    # seed 1 tries the first bad file 7th and stops before the second one
    assert [p.name for p, _ in three.skipped] == ["img002a.png", "zz_broken.png"][:2 if limit is None else 1]


@pytest.fixture(scope="module")
def quant_table(model_path, calib_dir, tmp_path_factory) -> Path:
    return calibrate_cli(model_path, calib_dir, tmp_path_factory.mktemp("table"), "--num-images", "4")


REPO = Path(__file__).resolve().parents[1]


def run_driver(code: str, start: str) -> list[str]:
    """`code` run by a fresh interpreter as the driver of a pool; returns how its pools started their workers.
    `start` 'fork': the driver as the command line is (forks); 'spawn': one that has loaded onnxruntime first
    (not safe to fork: it spawns)."""
    import subprocess
    import sys

    script = "\n".join([
        "import json, sys",
        f"sys.path[:0] = {[str(REPO), str(REPO / 'tests'), str(REPO / 'tests' / 'ops')]!r}",
        "import onnxruntime" if start == "spawn" else "",
        "from ptq.parallel import workers as parallel",
        "methods = []",
        "leave = parallel.LocalPool.__exit__",
        "parallel.LocalPool.__exit__ = lambda pool, *exc: (methods.extend(pool.methods), leave(pool, *exc))[1]",
        code,
        "print(json.dumps(methods))",
    ])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_report_with_two_workers_writes_the_one_process_report(model_path, eval_dir, quant_table, tmp_path, start):
    """7 labelled photos and an unreadable file among them; isolated metrics over the first 3 images span
    three shards. The two workers are forked by a driver like the command line, spawned by one that has
    loaded onnxruntime."""
    images = tmp_path / "images"
    images.mkdir()
    for path in sorted(eval_dir.iterdir())[:7]:
        shutil.copy(path, images / path.name)
    (images / "imagenet_02_999x.jpg").write_bytes(b"not a jpeg")
    args = ["report", str(model_path), "--quant", str(quant_table), "--images", str(images), "--isolated-images", "3"]
    assert main([*args, "--out", str(tmp_path / "one"), "--workers", "1"]) == 0
    methods = run_driver(f"from ptq.cli import main; assert main({[*args, '--out', str(tmp_path / 'two')]!r} + "
                         "['--workers', '2']) == 0", start)
    assert methods == [start]
    one, two = (json.loads((tmp_path / name / "report.json").read_text()) for name in ("one", "two"))
    assert one["images"] == 7 and one["isolated_images"] == 3
    assert two == one


@dataclass(frozen=True)
class DiesOnce:
    """A job whose worker process exits abruptly on the shard starting at `start`, the first time only."""

    inner: CalibrationJob
    start: int
    marker: str

    def setup(self):
        return self.inner.setup()

    def run(self, context, shard):
        if shard.start == self.start and not os.path.exists(self.marker):
            Path(self.marker).write_text("died here")
            os._exit(3)
        return self.inner.run(context, shard)


NEEDS = ("mean", "3std", "kld")


def sharded_with_a_death(model: str, images: str, marker: str, out: str) -> None:
    """In a driver: the statistics of `images` on two workers, one of which dies on the shard starting at image 6
    (the first time); the merged parts, the images used and the crash count are pickled to `out`."""
    import pickle

    from calibrators import required_stats

    files = sorted(Path(images).iterdir())
    pre = Preprocess(mean=0, std=255, crop_ratio=1.0)
    job = DiesOnce(CalibrationJob(model, None, ImageFormat(pre), required_stats(list(NEEDS))), start=6, marker=marker)
    log = ImageLog()
    with LocalPool(job, workers=2) as pool:
        parts = run_sharded(pool, files, log, limit=None, batch_size=2, shard_batches=1)
    merged = parts[0]
    for part in parts[1:]:
        for name, stats in merged.items():
            stats.merge(part[name])
    Path(out).write_bytes(pickle.dumps((merged, log.used, pool.crashes)))


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_worker_that_dies_mid_run_has_its_shard_rerun_with_the_same_result(tmp_path, start):
    """The pool breaks, the shards not finished are queued on a new pool (started by fork again: the pool's
    threads are gone by then and this driver has no progress bar)."""
    import pickle

    from calibrators import required_stats
    from ptq.core.graph import load_model
    from ptq.calibration.statistics import collect_image_statistics

    model, images, files = write_tiny_case(tmp_path, 12)
    pre, needs = Preprocess(mean=0, std=255, crop_ratio=1.0), required_stats(list(NEEDS))
    expected, _ = collect_image_statistics(load_model(str(model)), images, needs, preprocess=pre, batch_size=2)

    marker, out = tmp_path / "died", tmp_path / "merged.pickle"
    methods = run_driver(f"from test_parallel import sharded_with_a_death; "
                         f"sharded_with_a_death({str(model)!r}, {str(images)!r}, {str(marker)!r}, {str(out)!r})", start)
    merged, used, crashes = pickle.loads(out.read_bytes())
    assert crashes == 1 and marker.exists() and methods == [start, start]
    assert used == sorted(files) and list(merged) == list(expected)
    for name, stats in expected.items():
        got = merged[name]
        assert got.batch_extrema.as_arrays()[0].tobytes() == stats.batch_extrema.as_arrays()[0].tobytes()
        assert got.batch_extrema.as_arrays()[1].tobytes() == stats.batch_extrema.as_arrays()[1].tobytes()
        assert got.moments.m2.tobytes() == stats.moments.m2.tobytes()
        assert got.histogram.counts.tobytes() == stats.histogram.counts.tobytes()


def test_local_ray_cluster_writes_the_one_process_table(model_path, calib_dir, tmp_path):
    """Skipped only without Ray (CI installs the `ray` extra). The cluster is started here with 2 CPUs."""
    ray = pytest.importorskip("ray")
    flags = ["--calibrator", "mean", "--batch-size", "4", "--num-images", "12"]
    one = calibrate_cli(model_path, calib_dir, tmp_path / "w1", *flags)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = calibrate_cli(model_path, calib_dir, tmp_path / "ray", *flags, "--ray", "local")
    finally:
        ray.shutdown()
    assert digest(on_ray) == digest(one)


def test_run_with_two_workers_prints_the_one_process_lines(model_path, eval_dir, quant_table, tmp_path, capsys):
    images = tmp_path / "images"
    images.mkdir()
    for path in sorted(eval_dir.iterdir())[:5]:
        shutil.copy(path, images / path.name)
    (images / "imagenet_01_999.jpg").write_bytes(b"not a jpeg")  # labelled like the photos: labels stay on
    printed = []
    for workers in ("1", "2"):
        assert main(["run", str(model_path), "--quant", str(quant_table), "--images", str(images),
                     "--workers", workers]) == 0
        lines = capsys.readouterr().out.splitlines()
        printed.append([line for line in lines if "ms per image" not in line])
        assert sum("ms per image" in line for line in lines) == 1
    assert printed[1] == printed[0]
    assert printed[0][2] == "imagenet_01_999.jpg: skipped (cannot decode image: cannot identify image file "\
        f"'{images / 'imagenet_01_999.jpg'}')" and "top-1 accuracy" in "\n".join(printed[0])


def _session_processes(sid: int) -> list[int]:
    """Live processes of session `sid` (Linux /proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


INTERRUPTED_POOLS = """
import contextlib, multiprocessing, threading, time
from concurrent.futures.process import _ExecutorManagerThread
from ptq.parallel import workers as parallel


class Sleeps:
    def setup(self):
        return None

    def run(self, context, item):
        time.sleep(30)


def left_over():
    threads = [t for t in threading.enumerate() if isinstance(t, _ExecutorManagerThread)]
    return len(threads), len(multiprocessing.active_children())


def interrupted(pool):
    with contextlib.suppress(KeyboardInterrupt):
        with pool:
            pool.pool.submit(parallel._run_in_worker, 1)  # a worker busy with a shard
            raise KeyboardInterrupt
    return left_over()


@contextlib.contextmanager
def ctrl_c_on_unblock():  # the Ctrl-C that came while the pool started, delivered when the signal is unblocked
    yield
    raise KeyboardInterrupt


print("running", interrupted(parallel.LocalPool(Sleeps(), 2)))
parallel.worker_environment = ctrl_c_on_unblock
print("starting", interrupted(parallel.LocalPool(Sleeps(), 2)))
"""


def test_an_interrupted_pool_leaves_no_thread_to_race_the_exit():
    """Ctrl-C during a run (or while the pool starts): when the command returns, the pool's thread has ended and
    its workers are gone. A thread left running closed its wake-up pipe while the interpreter's exit hook wrote
    to it: `ptq report: interrupted` followed by a traceback (issue 27: the flaky report-workers-starting)."""
    import subprocess
    import sys

    script = f"import sys\nsys.path[:0] = {[str(REPO)]!r}\n" + INTERRUPTED_POOLS
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == ["running (0, 0)", "starting (0, 0)"]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
@pytest.mark.parametrize("command,delay", [("calibrate", 0.3), ("calibrate", 2.0), ("report", 0.3)],
                         ids=["calibrate-workers-starting", "calibrate-workers-running", "report-workers-starting"])
def test_ctrl_c_stops_the_workers_and_writes_nothing(model_path, calib_dir, quant_table, tmp_path, command, delay):
    """The command line's driver forks its workers (they run its command line); Ctrl-C while they set up
    (0.3 s: loading the compiled kernels and the float session; their SIGINT must already be blocked) or run."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    images = tmp_path / "images"  # 10 links to each photo: long enough that the run is still going when
    images.mkdir()                # the signal comes, however fast the machine
    for k in range(10):
        for photo in sorted(calib_dir.iterdir()):
            (images / f"{k}_{photo.name}").symlink_to(photo)
    flags = ["--calibrator", "kld"] if command == "calibrate" else ["--quant", str(quant_table)]
    command_line = [sys.executable, "-m", "ptq.cli", command, str(model_path), "--images", str(images),
                    "--out", str(out), "-q", "--workers", "2", *flags]
    # a background job of a non-interactive shell (how CI may start us) inherits SIGINT ignored: undo that
    process = subprocess.Popen(command_line, start_new_session=True, stderr=subprocess.PIPE, cwd=REPO,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while len(_session_processes(process.pid)) < 3 and time.monotonic() < deadline:  # driver, 2 workers
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before it could be interrupted"
    workers = [pid for pid in _session_processes(process.pid) if pid != process.pid]
    driver_line = Path(f"/proc/{process.pid}/cmdline").read_bytes()
    assert [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in workers] == [driver_line] * 2  # forked
    time.sleep(delay)
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130 and stderr == f"ptq {command}: interrupted\n".encode()  # one line, no traceback
    deadline = time.monotonic() + 10
    while _session_processes(process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _session_processes(process.pid) == []
    assert not out.exists() or list(out.iterdir()) == []


def test_default_workers_are_the_usable_cores_one_per_50_images_from_3_on(monkeypatch):
    from ptq.parallel import workers as parallel
    from ptq.cli import build_parser

    monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert parallel.usable_cores() == 4
    # 2 workers would take at best 1.7/2 of one process's time: one process until 3 workers have 50 images each
    assert [parallel.choose_workers(None, n) for n in (1, 49, 99, 100, 149, 150, 199, 5000)] == [1, 1, 1, 1, 1, 3, 3, 4]
    monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert parallel.choose_workers(None, 5000) == 1  # two cores: one process, which keeps both busy
    assert parallel.choose_workers(3, 5) == 3  # asked for: kept, however few the images
    for command in ("calibrate", "report", "run", "debug", "tune"):
        flags = {"calibrate": [], "tune": ["--quant", "q", "--target-cosine", "0.99"]}.get(command, ["--quant", "q"])
        extra = ["--out", "o"] if command in ("report", "debug") else []
        args = build_parser().parse_args([command, "m.onnx", "--images", "i", *flags, *extra])
        assert args.workers is None and args.ray is None


def test_report_workers_run_helper_threads_only_beside_idle_cores(monkeypatch):
    from ptq.parallel import workers as parallel
    from reports.evaluate_shards import worker_threads

    monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert [worker_threads(n, None) for n in (1, 3, 4, 6)] == [True, True, False, False]
    assert worker_threads(1, "local") is False  # a Ray task has one CPU


def test_debug_with_two_workers_writes_the_one_process_results(model_path, eval_dir, quant_table, tmp_path):
    """`ptq debug --auto`: a report and the suspects' trials, every evaluation on the same two workers."""
    images = tmp_path / "images"
    images.mkdir()
    for path in sorted(eval_dir.iterdir())[:5]:
        shutil.copy(path, images / path.name)
    results = []
    for workers in ("1", "2"):
        out = tmp_path / f"debug{workers}"
        assert main(["debug", str(model_path), "--quant", str(quant_table), "--images", str(images), "--auto", "2",
                     "--isolated-images", "3", "--out", str(out), "--workers", workers]) == 0
        results.append((json.loads((out / "debug.json").read_text()), json.loads((out / "report.json").read_text())))
    assert results[0][0]["mode"] == "auto" and len(results[0][0]["suspects"]) == 2
    assert results[1] == results[0]


def test_fake_quant_on_workers_gives_the_one_process_result(model_path, eval_dir, quant_table):
    from ptq.adjust.adjusted_model import load_model_for_table
    from ptq.table.quant_table import load_quant_table
    from reports.evaluate_shards import ShardedEvaluator
    from reports.fake_quant import fake_quant
    from ptq.data.image_source import ImageSet

    table = load_quant_table(quant_table)
    graph = load_model_for_table(model_path, table, quant_table)
    images = ImageSet.from_folder(eval_dir, Preprocess(**table.options.preprocess), limit=4)
    layer = graph.nodes[len(graph.nodes) // 2].outputs[0]
    one = fake_quant(graph, table, images, layers=[layer])
    with ShardedEvaluator.for_graph(graph, table, images, workers=2) as evaluator:
        two = fake_quant(graph, table, images, layers=[layer], evaluator=evaluator)
        with pytest.raises(ValueError, match="made for"):
            evaluator(load_model_for_table(model_path, table, quant_table), table, images)
    assert one.float_nodes and two.to_dict() == one.to_dict()


def test_tune_with_two_workers_writes_the_one_process_table(model_path, calib_dir, quant_table, tmp_path):
    """6 bundled photos (4 fitted, 2 deciding), no 16-bit budget: the range steps (statistics and the
    validation cosines on the workers); the ranking and re-corrected biases: tests/test_tune.py."""
    records, codes = [], []
    for workers in ("1", "2"):
        out = tmp_path / f"tune{workers}"
        codes.append(main(["tune", str(model_path), "--quant", str(quant_table), "--images", str(calib_dir),
                           "--num-images", "6", "--target-cosine", "0.999", "--budget-int16", "0", "--out", str(out),
                           "-q", "--workers", workers]))
        record = json.loads((out / f"{quant_table.name[:-len('.quant.json')]}.tune.json").read_text())
        records.append(((record.pop("tuned"), record.pop("qdq")), record))  # the written files, by content
    assert codes[0] == codes[1]
    assert records[0][1]["validation_samples"] == 2 and len(records[0][1]["steps"]) >= 3
    assert records[1][1] == records[0][1]
    assert [digest(Path(p)) for p in records[1][0]] == [digest(Path(p)) for p in records[0][0]]
