import gc
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Wall seconds per test file of the GPU suite, measured on an H100 (--record-durations): what
# --shard balances. A file not listed counts UNKNOWN_FILE_S.
DURATIONS = Path(__file__).with_name("gpu_durations.json")
UNKNOWN_FILE_S = 60.0


def pytest_addoption(parser):
    parser.addoption("--reverse", action="store_true",
                     help="run the collected tests in reverse order (to catch tests that depend on order)")
    parser.addoption("--random-order", type=int, default=None, metavar="SEED",
                     help="run the collected tests shuffled with this seed (to catch tests that depend on order)")
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run the K-th of N shards: whole test files, balanced by the wall times in "
                          "tests/gpu_durations.json (the GPU suite: nox -s gpu_tests -- --shard 1/7)")
    parser.addoption("--record-durations", default=None, metavar="PATH",
                     help="write each test's wall time (setup, call and teardown) and each file's sum as JSON")


def _shard(spec: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard takes K/N, e.g. 1/4 (got {spec!r})") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard {spec}: K must be between 1 and N")
    return k, n


# files whose tests need two GPUs (they skip on one): shard 1 holds them and nothing else, so the
# shard given two GPUs runs no one-GPU test with two visible (Trainer would wrap it in nn.DataParallel)
TWO_GPU_FILES = ("tests/test_distributed.py",)


def shard_files(files: list[str], n: int, seconds: dict[str, float]) -> list[list[str]]:
    """N lists of files, each file in exactly one: the two-GPU files alone in the first (where
    there are any and N > 1), the rest longest first into the lightest of the others."""
    shards: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    two = [f for f in files if f in TWO_GPU_FILES]
    shards[0].extend(two)
    rest = range(1, n) if two and n > 1 else range(n)
    for f in sorted((f for f in files if f not in TWO_GPU_FILES), key=lambda f: (-seconds.get(f, UNKNOWN_FILE_S), f)):
        i = min(rest, key=lambda j: (load[j], j))
        shards[i].append(f)
        load[i] += seconds.get(f, UNKNOWN_FILE_S)
    return shards


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: shards of what runs
def pytest_collection_modifyitems(config, items):
    import torch

    spec = config.getoption("--shard")
    if spec:
        k, n = _shard(spec)
        seconds = json.loads(DURATIONS.read_text())["files"] if DURATIONS.exists() else {}
        files = list(dict.fromkeys(_file(item) for item in items))
        mine = set(shard_files(files, n, seconds)[k - 1])
        keep = [it for it in items if _file(it) in mine]
        config.hook.pytest_deselected(items=[it for it in items if _file(it) not in mine])
        items[:] = keep
    if config.getoption("--reverse"):
        items.reverse()
    seed = config.getoption("--random-order")
    if seed is not None:
        # files in a random order, then each file's tests: a file's module-scoped fixtures (a
        # model built once, dynamo's caches reset) are set up once, not at every switch of file
        rng = random.Random(seed)
        by_file: dict[str, list] = {}
        for it in items:
            by_file.setdefault(_file(it), []).append(it)
        order = list(by_file)
        rng.shuffle(order)
        for tests in by_file.values():
            rng.shuffle(tests)
        items[:] = [it for f in order for it in by_file[f]]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `nox -s gpu_tests` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _file(item) -> str:
    return item.location[0]  # relative to the rootdir: tests/test_gpu_moe.py


_started: dict[str, float] = {}
_took: dict[str, float] = {}


def pytest_runtest_logstart(nodeid, location):
    _started[nodeid] = time.perf_counter()


def pytest_runtest_logfinish(nodeid, location):
    _took[nodeid] = time.perf_counter() - _started.pop(nodeid, time.perf_counter())


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--record-durations")
    if not path:
        return
    files: dict[str, float] = {}
    for nodeid, s in _took.items():
        f = nodeid.split("::")[0]
        files[f] = round(files.get(f, 0.0) + s, 1)
    Path(path).write_text(json.dumps({"tests": {k: round(v, 2) for k, v in _took.items()}, "files": files},
                                     indent=1, sort_keys=True) + "\n")


def _loggers() -> dict:
    """Each logger's level, handlers, propagation and disabled flag; the root's handlers are
    pytest's own."""
    out = {"": (logging.getLogger().level, None, True, False)}
    for name, lg in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(lg, logging.Logger):
            out[name] = (lg.level, list(lg.handlers), lg.propagate, lg.disabled)
    return out


@pytest.fixture(autouse=True)
def _process_as_found(request):
    """Every test leaves the process as it found it: environment, loggers, grad mode, default
    dtype and the cycle collector's thresholds (optim.collector raises them); on a GPU also the allocator (cache emptied), CUDA's peak statistics (reset before, so no
    test reads another's peak) and optim's packing cache and counters."""
    import torch

    env, loggers, disabled_below = dict(os.environ), _loggers(), logging.root.manager.disable
    grad, dtype = torch.is_grad_enabled(), torch.get_default_dtype()
    thresholds = gc.get_threshold()
    gpu = "gpu" in request.keywords and torch.cuda.is_available()
    if gpu:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    yield
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    logging.disable(disabled_below)
    for name, (level, handlers, propagate, disabled) in loggers.items():
        lg = logging.getLogger(name or None)
        lg.setLevel(level)
        if handlers is not None:
            lg.handlers[:] = handlers
        lg.propagate, lg.disabled = propagate, disabled
    torch.set_grad_enabled(grad)
    torch.set_default_dtype(dtype)
    gc.set_threshold(*thresholds)
    if "optim.packing" in sys.modules:
        sys.modules["optim.packing"].release()
        sys.modules["optim.packing"].reset_counters()
    if gpu:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True, scope="module")
def _compiled_code_per_file(request):
    """A GPU test file starts and ends with dynamo's caches empty: no file's compiled graphs, or
    the recompile budget they used, reach another's."""
    import torch

    gpu = any("gpu" in item.keywords for item in request.session.items
               if getattr(item, "module", None) is request.module) and torch.cuda.is_available()
    if gpu:
        torch._dynamo.reset()
    yield
    if gpu:
        torch._dynamo.reset()


@pytest.fixture
def write_toml(tmp_path):
    def _write(text: str, name: str = "exp.toml") -> Path:
        p = tmp_path / name
        p.write_text(text)
        return p

    return _write


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: on a small CPU machine shared with other jobs, a tiny
    model's steps run several times faster so (the tests that train a model ask for it)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def unsloth_stand_in(tmp_path, monkeypatch):
    """A stand-in ``unsloth`` package on the child processes' path, which records which of torch,
    transformers and peft were already imported when the process imported it (Unsloth patches
    them at import, so it must come first) and whether the Hub was set offline: the file this
    returns gets a line ``"<modules>|<HF_HUB_OFFLINE>"`` per process that imported it."""
    fake = tmp_path / "site" / "unsloth"
    fake.mkdir(parents=True)
    seen = tmp_path / "seen.txt"
    (fake / "__init__.py").write_text(
        "import os, sys\n"
        f"open({str(seen)!r}, 'a').write(' '.join(m for m in ('torch', 'transformers', 'peft') if m in sys.modules)"
        " + '|' + os.environ.get('HF_HUB_OFFLINE', '') + '\\n')\n")
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))
    return seen
