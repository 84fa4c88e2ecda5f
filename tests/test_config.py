"""The TOML config: defaults, the shipped file, and errors that name the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ipc.messages import LoadRequest
from supervisor.config import (
    HTTP_ENV,
    ConfigError,
    ModelConfig,
    SupervisorConfig,
    load_config,
    spec_problem,
    with_http_override,
)
from supervisor.registry.entries import RequestError
from supervisor.registry.specs import engine_settings, merge_spec

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_shipped_config_decodes_to_the_defaults() -> None:
    assert load_config(CONFIGS / "mlx-supervisor.toml") == SupervisorConfig()


def test_shipped_config_names_every_key() -> None:
    text = (CONFIGS / "mlx-supervisor.toml").read_text()
    for key in SupervisorConfig.__struct_fields__:
        assert f"{key} =" in text or f"# {key} =" in text or key == "models", key


def test_shipped_config_commented_model_table_is_valid(tmp_path: Path) -> None:
    text = (CONFIGS / "mlx-supervisor.toml").read_text()
    uncommented = text.replace("# [[models]]", "[[models]]")
    for key in ("name", "model", "max_tokens", "preload", "restart", "env", "kv_bits",
                "kv_group_size"):  # fmt: skip
        uncommented = uncommented.replace(f"# {key} ", f"{key} ")
    path = tmp_path / "c.toml"
    path.write_text(uncommented)
    (model,) = load_config(path).models
    assert model.name == "qwen" and model.max_tokens == 4096
    assert model.env == {"MLX_METAL_FAST_SYNCH": "1"}
    assert model.restart == "on-failure"
    assert (model.kv_bits, model.kv_group_size) == (8, 64)


def test_unknown_key_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("shutdown_grace_s = 1.0\nshutdwon_grace = 2\n")
    with pytest.raises(ConfigError, match="shutdwon_grace"):
        load_config(path)
    path.write_text('[[models]]\nname = "a"\nmodel = "builtin:tiny"\nmax_token = 3\n')
    with pytest.raises(ConfigError, match="max_token"):
        load_config(path)


def test_wrong_type_and_bad_toml_are_errors(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('term_grace_s = "soon"\n')
    with pytest.raises(ConfigError, match="term_grace_s"):
        load_config(path)
    path.write_text("term_grace_s = \n")
    with pytest.raises(ConfigError, match=str(path)):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")


def test_a_config_that_is_not_utf8_is_an_error_saying_so(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_bytes(b"max_queue = 5\n# caf\xe9 in Latin-1\n")
    with pytest.raises(ConfigError, match="not UTF-8") as excinfo:
        load_config(path)
    assert str(path) in str(excinfo.value) and excinfo.value.key is None


def test_repeated_model_names_are_an_error(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    model = '[[models]]\nname = "a"\nmodel = "builtin:tiny"\n'
    path.write_text(model + model)
    with pytest.raises(ConfigError, match="repeated: a"):
        load_config(path)


def serve_with_config(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    """Run ``serve`` with ``text`` as its config (expected to refuse it)."""
    path = tmp_path / "c.toml"
    path.write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "serve", "--config", str(path),
         "--socket", str(tmp_path / "s.sock")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("text", "named"),
    [("bogus = 1\n", "bogus"), ("runner_stderr_lines = -1\n", "runner_stderr_lines")],
)
def test_serve_with_bad_config_exits_1_with_the_reason(
    tmp_path: Path, text: str, named: str
) -> None:
    result = serve_with_config(tmp_path, text)
    assert result.returncode == 1
    assert named in result.stderr
    assert not (tmp_path / "s.sock").exists()


def test_service_print_renders_both_kinds(tmp_path: Path) -> None:
    for kind in ("launchd", "systemd"):
        result = subprocess.run(
            [sys.executable, "-m", "supervisor", "service", "print", kind,
             "--socket", str(tmp_path / "s.sock")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert str(tmp_path / "s.sock") in result.stdout
        assert "serve" in result.stdout


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("runner_stderr_lines = -1", r"`int` >= 0 - at `\$.runner_stderr_lines`"),
        ("ping_timeout_s = 0", r"`float` >= 0.2 - at `\$.ping_timeout_s`"),
        ("decode_stall_s = -5.0", r"`float` > 0.0 - at `\$.decode_stall_s`"),
        ("max_queue = -1", r"`int` >= 0 - at `\$.max_queue`"),
        ("max_connections = 0", r"`int` >= 1 - at `\$.max_connections`"),
        ("max_frame_bytes = 10", r"`int` >= 4096 - at `\$.max_frame_bytes`"),
        ("allowed_uids = [-3]", r"`int` >= 0 - at `\$.allowed_uids\[0\]`"),
        ("client_write_timeout_s = 0", r"`float` > 0.0 - at `\$.client_write_timeout_s`"),
    ],
)
def test_out_of_range_values_are_errors_naming_key_and_range(
    tmp_path: Path, line: str, expected: str
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=expected):
        load_config(path)


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ('name = "a/b"\nmodel = "builtin:tiny"', "hold no '/'"),
        ('name = "x"\nmodel = "builtin:tiny"\nenv = { LD_PRELOAD = "/x.so" }', "LD_PRELOAD"),
        ('name = "x"\nmodel = ""', "length >= 1"),
    ],
)
def test_bad_model_tables_are_errors(tmp_path: Path, model: str, expected: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f"[[models]]\n{model}\n")
    with pytest.raises(ConfigError, match=expected):
        load_config(path)


@pytest.mark.parametrize(
    ("listen", "key", "refused"),
    [("0.0.0.0:11480", None, True), ("192.168.1.5:80", None, True), ("myhost:80", None, True),
     ("0.0.0.0:11480", 'api_key = "s3cret"\n', False), ("127.0.0.1:0", None, False),
     ("localhost:11480", None, False), ("[::1]:11480", None, False), ("off", None, False)],
)  # fmt: skip
@pytest.mark.parametrize("on_demand", ['"any"', "true", "false"])
def test_an_http_front_beyond_loopback_needs_an_api_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, listen: str, key: str | None, refused: bool,
    on_demand: str,
) -> None:
    # Whoever reaches the front can run generations, and load the configured
    # models (or any, with "any"): beyond loopback that is the whole network.
    path = tmp_path / "c.toml"
    path.write_text(f'load_on_demand = {on_demand}\nhttp_listen = "{listen}"\n{key or ""}')
    if refused:
        with pytest.raises(ConfigError, match="set api_key, or listen on loopback only"):
            load_config(path)
    else:
        load_config(path)
    loopback = tmp_path / "loopback.toml"
    loopback.write_text(f'load_on_demand = {on_demand}\n{key or ""}')
    config = load_config(loopback)
    monkeypatch.setenv(HTTP_ENV, listen)  # the same, from $MLX_SUPERVISOR_HTTP or serve --http
    if refused:
        with pytest.raises(ConfigError, match=HTTP_ENV):
            with_http_override(config, None)
        with pytest.raises(ConfigError, match="--http"):
            with_http_override(config, listen)
    else:
        assert with_http_override(config, listen).http_listen == listen


def test_http_allowed_hosts_takes_names_and_addresses_without_ports(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    hosts = ["mybox.lan", "MyBox.Lan.", "192.0.2.7", "[::1]", "::1", "fd00::7", "*"]
    path.write_text(f"http_allowed_hosts = {hosts!r}\n".replace("'", '"'))
    assert load_config(path).http_allowed_hosts == hosts
    assert SupervisorConfig().http_allowed_hosts == []
    for bad in ("mybox.lan:8080", "http://mybox.lan", "", "a b", "*.lan", "[::1]:80"):
        path.write_text(f'http_allowed_hosts = ["{bad}"]\n')
        with pytest.raises(ConfigError, match=r"http_allowed_hosts"):
            load_config(path)


def model_table(path: Path, extra: str) -> Path:
    path.write_text(f'[[models]]\nname = "q"\nmodel = "builtin:tiny"\n{extra}\n')
    return path


@pytest.mark.parametrize(
    ("extra", "expected"),
    [("", (None, 64)), ("kv_bits = 8", (8, 64)), ("kv_bits = 4\nkv_group_size = 32", (4, 32)),
     ("kv_bits = 8\nkv_group_size = 128", (8, 128))],
)  # fmt: skip
def test_kv_bits_and_group_size_are_per_model_settings(
    tmp_path: Path, extra: str, expected: tuple[int | None, int]
) -> None:
    (model,) = load_config(model_table(tmp_path / "c.toml", extra)).models
    assert (model.kv_bits, model.kv_group_size) == expected


@pytest.mark.parametrize(
    "extra",
    ["kv_bits = 2", "kv_bits = 16", 'kv_bits = "8"', "kv_bits = 8.0", "kv_group_size = 16",
     "kv_group_size = 256", "kv_group_size = 48"],
)  # fmt: skip
def test_kv_bits_and_group_size_outside_what_mlx_quantizes_are_errors_naming_the_key(
    tmp_path: Path, extra: str
) -> None:
    key = extra.split(" ")[0]
    with pytest.raises(ConfigError, match=rf"\$\.models\[0\]\.{key}"):
        load_config(model_table(tmp_path / "c.toml", extra))


def test_kv_bits_is_refused_in_a_distributed_group_for_now(tmp_path: Path) -> None:
    for group in ("ranks = 2", 'hostfile = "/etc/mlx/hosts.json"'):
        path = model_table(tmp_path / "c.toml", f"kv_bits = 8\n{group}")
        with pytest.raises(ConfigError, match="kv_bits with a distributed group"):
            load_config(path)
    alone = ModelConfig(name="q", model="builtin:tiny", kv_bits=8, ranks=1)
    assert spec_problem(alone) is None
    grouped = ModelConfig(name="q", model="builtin:tiny", kv_bits=8, ranks=2)
    assert spec_problem(grouped, places=False) == (
        "kv_bits with a distributed group (ranks, hostfile): not yet"
    )
    assert spec_problem(ModelConfig(name="q", model="builtin:tiny", ranks=2)) is None


def test_a_load_request_s_kv_settings_win_over_the_config_s_and_reach_the_engine(
    tmp_path: Path,
) -> None:
    config = load_config(model_table(tmp_path / "c.toml", "kv_bits = 4\nkv_group_size = 32"))
    configured = merge_spec(config, LoadRequest(model="builtin:tiny", name="q"))
    assert (configured.kv_bits, configured.kv_group_size) == (4, 32)
    engine = engine_settings(config, configured)
    assert (engine.kv_bits, engine.kv_group_size) == (4, 32)
    asked = merge_spec(config, LoadRequest(model="builtin:tiny", name="q", kv_bits=8))
    assert (asked.kv_bits, asked.kv_group_size) == (8, 32)  # the group size stays configured
    unquantized = merge_spec(config, LoadRequest(model="builtin:tiny", name="other"))
    assert engine_settings(config, unquantized).kv_bits is None
    for bad in ({"kv_bits": 3}, {"kv_group_size": 100}):
        with pytest.raises(RequestError, match="kv_") as excinfo:
            merge_spec(config, LoadRequest(model="builtin:tiny", **bad))
        assert excinfo.value.code == "bad_request"


# --- aliases, request defaults, and errors that name the key (issue 27) --------------


def test_aliases_are_names_of_the_model_everywhere_a_name_is(tmp_path: Path) -> None:
    config = load_config(model_table(tmp_path / "c.toml", 'aliases = ["fast", "q-chat"]'))
    (spec,) = config.models
    assert spec.names == ["q", "fast", "q-chat"]
    assert config.model_config("fast") is spec and config.model_config("q") is spec
    assert config.model_config("slow") is None
    loaded = merge_spec(config, LoadRequest(model="builtin:tiny", name="fast"))
    assert loaded.name == "q" and loaded.aliases == ["fast", "q-chat"]  # under its own name


@pytest.mark.parametrize(
    ("tables", "key", "expected"),
    [
        ('name = "q"\nmodel = "m"\naliases = ["a/b"]', "models[0].aliases", "hold no '/'"),
        ('name = "q"\nmodel = "m"\naliases = ["q"]', "models[0].aliases", "repeats"),
        ('name = "q"\nmodel = "m"\naliases = ["x", "x"]', "models[0].aliases", "repeats"),
        ('name = "q"\nmodel = "m"\naliases = [""]', "models[0].aliases", "must not be empty"),
        ('name = "q"\nmodel = "m"\naliases = ["r"]\n[[models]]\nname = "r"\nmodel = "m"',
         "models", "names or aliases repeated: r"),
        ('name = "q"\nmodel = "m"\naliases = ["x"]\n[[models]]\nname = "r"\nmodel = "m"\n'
         'aliases = ["x"]', "models", "repeated: x"),
    ],
)  # fmt: skip
def test_bad_aliases_are_errors_naming_the_key(
    tmp_path: Path, tables: str, key: str, expected: str
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f"[[models]]\n{tables}\n")
    with pytest.raises(ConfigError, match=expected) as excinfo:
        load_config(path)
    assert excinfo.value.key == key


def test_request_defaults_are_model_keys_with_their_ranges(tmp_path: Path) -> None:
    extra = ('temperature = 0.7\ntop_p = 0.9\ntop_k = 40\nmin_p = 0.05\n'
             'repetition_penalty = 1.1\npresence_penalty = -0.5\nfrequency_penalty = 0.5\n'
             'seed = 42\nmax_tokens = 2048\ndefault_max_tokens = 512\n'
             'system_prompt = "You are terse."')  # fmt: skip
    (spec,) = load_config(model_table(tmp_path / "c.toml", extra)).models
    assert (spec.temperature, spec.top_p, spec.top_k, spec.min_p) == (0.7, 0.9, 40, 0.05)
    assert (spec.repetition_penalty, spec.presence_penalty, spec.frequency_penalty) == (
        1.1, -0.5, 0.5,
    )  # fmt: skip
    assert (spec.seed, spec.default_max_tokens, spec.system_prompt) == (42, 512, "You are terse.")
    # A load by name takes them with the rest of the model's settings.
    merged = merge_spec(load_config(tmp_path / "c.toml"), LoadRequest(model="builtin:tiny",
                                                                     name="q"))  # fmt: skip
    assert merged.system_prompt == "You are terse." and merged.temperature == 0.7


@pytest.mark.parametrize(
    ("extra", "key", "expected"),
    [
        ("temperature = -0.1", "models[0].temperature", ">= 0"),
        ("top_p = 1.5", "models[0].top_p", "<= 1.0"),
        ("top_k = -1", "models[0].top_k", ">= 0"),
        ("min_p = 2", "models[0].min_p", "<= 1"),
        ("repetition_penalty = 0", "models[0].repetition_penalty", "> 0"),
        ("presence_penalty = 3", "models[0].presence_penalty", "<= 2"),
        ("frequency_penalty = -3", "models[0].frequency_penalty", ">= -2"),
        ("seed = -1", "models[0].seed", ">= 0"),
        ('seed = "7"', "models[0].seed", "Expected `int | null`"),
        ("default_max_tokens = 0", "models[0].default_max_tokens", ">= 1"),
        ("max_tokens = 100\ndefault_max_tokens = 101", "models[0].default_max_tokens",
         "101 is above the model's cap max_tokens = 100"),
        ("default_max_tokens = 5000", "models[0].default_max_tokens", "cap max_tokens = 4096"),
        ('system_prompt = ""', "models[0].system_prompt", "length >= 1"),
        ("system_promt = 'x'", "models[0].system_promt", "unknown field"),
    ],
)  # fmt: skip
def test_bad_request_defaults_are_errors_naming_the_key(
    tmp_path: Path, extra: str, key: str, expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected) as excinfo:
        load_config(model_table(tmp_path / "c.toml", extra))
    assert excinfo.value.key == key


def test_config_errors_name_their_key_and_toml_errors_their_line(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    for text, key in (("bogus = 1\n", "bogus"), ("max_queue = -1\n", "max_queue"),
                      ('http_listen = "nowhere"\n', "http_listen"),
                      ("[[models]]\nname = 1\n", "models[0].name")):  # fmt: skip
        path.write_text(text)
        with pytest.raises(ConfigError) as excinfo:
            load_config(path)
        assert excinfo.value.key == key, text
    path.write_text("max_queue = \n")
    with pytest.raises(ConfigError, match="line 1") as excinfo:
        load_config(path)
    assert excinfo.value.key is None


def test_shipped_config_commented_request_defaults_are_valid(tmp_path: Path) -> None:
    text = (CONFIGS / "mlx-supervisor.toml").read_text().replace("# [[models]]", "[[models]]")
    keys = ("name", "model", "max_tokens", "aliases", "temperature", "top_p", "top_k", "min_p",
            "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
            "default_max_tokens", "system_prompt")  # fmt: skip
    for key in keys:
        assert text.count(f"# {key} ") == 1, key
        text = text.replace(f"# {key} ", f"{key} ")
    path = tmp_path / "shipped.toml"
    path.write_text(text)
    (model,) = load_config(path).models
    assert model.aliases == ["qwen3", "small"] and model.names[0] == "qwen"
    assert (model.temperature, model.top_p, model.seed) == (0.7, 0.9, 42)
    assert model.default_max_tokens == 1024 and model.max_tokens == 4096
    assert model.system_prompt == "You are a concise assistant."


def test_an_image_cap_over_the_frame_limit_is_refused_and_the_default_fits(
    tmp_path: Path,
) -> None:
    from supervisor.fronts.http.images import image_cap, images_budget

    path = tmp_path / "c.toml"
    path.write_text("max_frame_bytes = 1048576\nmax_image_bytes = 2097152\n")
    with pytest.raises(ConfigError, match="max_image_bytes") as caught:
        load_config(path)
    assert caught.value.key == "max_image_bytes"
    path.write_text("max_frame_bytes = 131072\n")  # no image key: the default shrinks to fit
    config = load_config(path)
    assert image_cap(config) == images_budget(config) < config.max_frame_bytes
