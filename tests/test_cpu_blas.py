"""The BLAS a runner computes with on a Linux CPU (``cpu_blas``).

mlx's Linux CPU wheel bundles netlib's reference BLAS; runners get OpenBLAS
preloaded where the machine has it. The choice is unit-tested on made-up
directories; the live tests check a real runner's memory map (the library
really is in the process) and that a real model still answers right with it.
They skip on a machine without OpenBLAS or without the bundled reference BLAS
(macOS, a CUDA build): there is nothing to choose there.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from conftest import DaemonFactory, runner
from supervisor.client import Client, ClientError
from supervisor.config import ConfigError, load_config
from supervisor.runners.blas import (
    AUTO,
    BUNDLED,
    CPU_BLAS_ENV,
    bundled_reference_blas,
    find_openblas,
    preload_for,
    runner_blas_env,
)

OPENBLAS = find_openblas() or Path("/nonexistent")
REFERENCE = bundled_reference_blas()
live = pytest.mark.skipif(
    not OPENBLAS.is_file() or REFERENCE is None,
    reason="needs mlx-cpu's bundled reference BLAS and an OpenBLAS (Debian: libopenblas0-pthread)",
)


def test_auto_preloads_openblas_only_over_the_bundled_reference_blas(tmp_path: Path) -> None:
    openblas = tmp_path / "libopenblas.so.0"
    reference = tmp_path / "libblas-0123abcd.so.3.10.0"
    assert preload_for(AUTO, system="linux", bundled=reference, openblas=openblas) == openblas
    assert preload_for(BUNDLED, system="linux", bundled=reference, openblas=openblas) is None
    assert preload_for(AUTO, system="darwin", bundled=reference, openblas=openblas) is None
    assert preload_for("/opt/blis/libblis.so", system="linux") == Path("/opt/blis/libblis.so")


def test_the_bundled_library_and_openblas_are_found_where_wheels_and_distributions_put_them(
    tmp_path: Path,
) -> None:
    site = tmp_path / "site-packages"
    (site / "mlx").mkdir(parents=True)
    assert bundled_reference_blas(site) is None  # a wheel without it (macOS, CUDA)
    (site / "mlx_cpu.libs").mkdir()
    bundled = site / "mlx_cpu.libs" / "libblas-bd8a282c.so.3.10.0"
    bundled.write_bytes(b"")
    assert bundled_reference_blas(site) == bundled

    first, second = tmp_path / "openblas-pthread", tmp_path / "lib"
    second.mkdir()
    assert find_openblas([first, second]) is None
    (second / "libopenblas.so.0").write_bytes(b"")
    assert find_openblas([first, second]) == second / "libopenblas.so.0"


def test_the_preload_goes_in_front_of_the_daemons_own_and_the_environment_overrides(
    tmp_path: Path,
) -> None:
    library = tmp_path / "libmyblas.so"
    library.write_bytes(b"")
    env = runner_blas_env(str(library), {"LD_PRELOAD": "/usr/lib/libjemalloc.so"})
    assert env == {"LD_PRELOAD": f"{library} /usr/lib/libjemalloc.so"}
    assert runner_blas_env(str(library), {CPU_BLAS_ENV: BUNDLED}) == {}
    assert runner_blas_env(BUNDLED, {CPU_BLAS_ENV: str(library)}) == {"LD_PRELOAD": str(library)}
    with pytest.raises(ValueError, match=r"cpu_blas: .*missing\.so is not a file"):
        runner_blas_env(str(tmp_path / "missing.so"), {})


def test_a_relative_or_unknown_setting_is_refused_naming_the_key(tmp_path: Path) -> None:
    for value in ("openblas", "lib/libblas.so", ""):
        path = tmp_path / "bad.toml"
        path.write_text(f"cpu_blas = {value!r}\n")
        with pytest.raises(ConfigError, match="cpu_blas"):
            load_config(path)
    path = tmp_path / "good.toml"
    path.write_text('cpu_blas = "bundled"\n')
    assert load_config(path).cpu_blas == BUNDLED
    assert load_config(None).cpu_blas == AUTO


def mapped(pid: int) -> set[str]:
    return {m.path for m in psutil.Process(pid).memory_maps() if "blas" in m.path}


def config(setting: str) -> str:
    return f'cpu_blas = "{setting}"\n'


@live
def test_a_runner_computes_with_the_library_the_setting_names(
    start_daemon: DaemonFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CPU_BLAS_ENV)  # the tests' pin to the bundled BLAS: this test chooses
    for setting, expect_openblas in ((AUTO, True), (BUNDLED, False)):
        daemon = start_daemon(config(setting))
        client = Client(daemon.socket_path)
        client.load("builtin:tiny", "m")
        _, done = client.generate_text("m", prompt="Hello", max_tokens=4)
        assert done.generation_tokens == 4
        pid = runner(client, "m").pid
        assert pid is not None
        libraries = mapped(pid)
        assert (str(OPENBLAS.resolve()) in libraries) is expect_openblas, (setting, libraries)
        daemon.terminate(timeout_s=30)


@live
def test_a_missing_library_fails_the_load_naming_the_key_and_the_daemon_serves_on(
    start_daemon: DaemonFactory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(CPU_BLAS_ENV)
    daemon = start_daemon(config(str(tmp_path / "gone.so")))
    client = Client(daemon.socket_path)
    with pytest.raises(ClientError, match=r"cpu_blas: .*gone\.so is not a file"):
        client.load("builtin:tiny", "m")
    assert client.status().supervisor.pid == daemon.pid  # still answering


@pytest.mark.slow
@live
@pytest.mark.timeout(900)  # the first run fetches builtin:smollm2 (93 MB)
def test_a_real_model_still_answers_paris_with_openblas(
    start_daemon: DaemonFactory, monkeypatch: pytest.MonkeyPatch, smollm2_dir: Path
) -> None:
    monkeypatch.delenv(CPU_BLAS_ENV)
    daemon = start_daemon(config(AUTO))
    client = Client(daemon.socket_path)
    client.load("builtin:smollm2", "m")
    text, _ = client.generate_text(
        "m",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0.0,
    )
    pid = runner(client, "m").pid
    assert pid is not None and str(OPENBLAS.resolve()) in mapped(pid)
    assert "Paris" in str(text)
