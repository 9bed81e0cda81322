"""services.common.config: one dataclass from flags > DEEPINFER_* env > defaults."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from services.common import ConfigError, load_config
from services.engine.config import EngineConfig
from services.gateway.config import GatewayConfig
from services.kvstore.config import KvstoreConfig
from services.launcher import StackConfig


@dataclass
class DemoConfig:
    name: str = field(metadata={"help": "required"})
    port: int = 8000
    ratio: float = 0.5
    verbose: bool = False
    volumes: list[str] = field(default_factory=list, metadata={"flag": "volume"})


def test_defaults_env_and_flags_in_order():
    env = {"DEEPINFER_DEMO_PORT": "9000", "DEEPINFER_DEMO_NAME": "from-env", "DEEPINFER_DEMO_VOLUMES": "/a,/b",
           "DEEPINFER_DEMO_VERBOSE": "yes"}
    c = load_config(DemoConfig, "demo", [], env)
    assert (c.name, c.port, c.ratio, c.verbose, c.volumes) == ("from-env", 9000, 0.5, True, ["/a", "/b"])
    c = load_config(DemoConfig, "demo", ["--port", "9100", "--volume", "/x", "--volume", "/y", "--no-verbose"], env)
    assert (c.port, c.volumes, c.verbose) == (9100, ["/x", "/y"], False)


def test_errors_name_the_flag_or_variable():
    with pytest.raises(ConfigError, match="--name"):
        load_config(DemoConfig, "demo", [], {})
    with pytest.raises(ConfigError, match="DEEPINFER_DEMO_PORT"):
        load_config(DemoConfig, "demo", ["--name", "n"], {"DEEPINFER_DEMO_PORT": "eighty"})
    with pytest.raises(ConfigError, match="--ratio"):
        load_config(DemoConfig, "demo", ["--name", "n", "--ratio", "half"], {})


def test_kvstore_config_validates_itself():
    c = load_config(KvstoreConfig, "kvstore", ["--fingerprint", "fp", "--num-layers", "8", "--volume", "/tmp/v"], {})
    assert (c.port, c.host, c.geometry.block_bytes, c.budget_bytes) == (8100, "127.0.0.1", 73_728, None)
    with pytest.raises(ConfigError, match="volume"):
        load_config(KvstoreConfig, "kvstore", ["--fingerprint", "fp", "--num-layers", "8"], {})
    with pytest.raises(ConfigError, match="port"):
        load_config(KvstoreConfig, "kvstore", ["--fingerprint", "fp", "--num-layers", "8", "--volume", "v",
                                               "--port", "70000"], {})


@pytest.mark.parametrize("cls, prefix", [(KvstoreConfig, "kvstore"), (EngineConfig, "engine"),
                                         (GatewayConfig, "gateway"), (StackConfig, "up")])
def test_help_lists_flags_and_the_secret_variables(cls, prefix, capsys):
    """--help renders (a bare % in a help text used to crash it) and names each secret's variables."""
    with pytest.raises(SystemExit) as done:
        load_config(cls, prefix, ["--help"], {})
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert f"DEEPINFER_{prefix.upper()}_ADMIN_TOKEN[_FILE]" in text and "--admin-token" not in text


def test_secret_from_a_file_drops_one_newline_and_refuses_both_sources(tmp_path):
    (tmp_path / "token").write_text("s3cret\n")
    env = {"DEEPINFER_KVSTORE_SERVICE_TOKEN_FILE": str(tmp_path / "token")}
    config = load_config(KvstoreConfig, "kvstore", ["--fingerprint", "f", "--num-layers", "1", "--volume", "v"], env)
    assert config.service_token == "s3cret" and "s3cret" not in repr(config)
    with pytest.raises(ConfigError, match="not both"):
        load_config(KvstoreConfig, "kvstore", ["--fingerprint", "f", "--num-layers", "1", "--volume", "v"],
                    env | {"DEEPINFER_KVSTORE_SERVICE_TOKEN": "x"})
    with pytest.raises(ConfigError, match="must not contain a password"):
        load_config(KvstoreConfig, "kvstore", ["--fingerprint", "f", "--num-layers", "1", "--volume", "v",
                                               "--redis-url", "redis://u:pw@h:1/0"], {})
