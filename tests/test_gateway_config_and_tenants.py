"""GatewayConfig from flags, environment and secret files; API keys -> tenants and their salts."""
import hashlib

import pytest

from services.common import ConfigError
from services.gateway.config import GatewayConfig, api_keys
from services.gateway.openai_errors import OpenAIError
from services.gateway.tenants import PUBLIC_TENANT, TenantKeys, admin_allowed, tenant_salt


def test_defaults():
    config = GatewayConfig.load([], {})
    assert (config.host, config.port, config.engines, config.open_access) == (
        "127.0.0.1", 8000, [], False)


def test_flags_beat_environment():
    env = {"DEEPINFER_GATEWAY_PORT": "9001", "DEEPINFER_GATEWAY_ENGINES": "http://a:1,http://b:2",
           "DEEPINFER_GATEWAY_OPEN_ACCESS": "true", "DEEPINFER_GATEWAY_LOOKUP_TIMEOUT_S": "0.25",
           "DEEPINFER_GATEWAY_TOKENIZER_JSON": "/tmp/t.json", "DEEPINFER_GATEWAY_API_KEYS": "k1:t1"}
    config = GatewayConfig.load(["--port", "9002"], env)
    assert config.port == 9002 and config.api_keys == "k1:t1"
    assert config.engines == ["http://a:1", "http://b:2"] and config.open_access
    assert config.lookup_timeout_s == 0.25 and config.tokenizer_json == "/tmp/t.json"
    flags = GatewayConfig.load(["--engine", "http://c:3", "--engine", "http://d:4",
                                "--no-open-access"], env)
    assert flags.engines == ["http://c:3", "http://d:4"] and not flags.open_access


@pytest.mark.parametrize("argv, env", [
    (["--port", "0"], {}), (["--engine", "a:1"], {}), ([], {"DEEPINFER_GATEWAY_API_KEYS": "nokey"}),
    (["--redis-url", "redis://u:pw@127.0.0.1:6379/0"], {}),
    ([], {"DEEPINFER_GATEWAY_SALT_KEY": "a", "DEEPINFER_GATEWAY_SALT_KEY_FILE": "/dev/null"}),
    ([], {"DEEPINFER_GATEWAY_ADMIN_TOKEN_FILE": "/nonexistent/admin_token"}),
    ([], {"DEEPINFER_GATEWAY_OPEN_ACCESS": "maybe"}), (["--lookup-timeout-s", "0"], {}),
    (["--default-max-tokens", "0"], {}), (["--port", "eighty"], {})])
def test_bad_values_fail_at_startup(argv, env):
    with pytest.raises(ConfigError):
        GatewayConfig.load(argv, env)


@pytest.mark.parametrize("flag", ["--api-keys", "--admin-token", "--salt-key", "--service-token",
                                  "--redis-password"])
def test_secrets_have_no_flags(flag, capsys):
    with pytest.raises(SystemExit):
        GatewayConfig.load([flag, "k1:t1"], {})
    assert "unrecognized arguments" in capsys.readouterr().err


def test_secrets_come_from_the_environment_or_files_never_flags(tmp_path):
    (tmp_path / "salt").write_text("salt-from-file\n")
    (tmp_path / "keys").write_text("k1:t1,k2:t2")
    config = GatewayConfig.load([], {"DEEPINFER_GATEWAY_SALT_KEY_FILE": str(tmp_path / "salt"),
                                     "DEEPINFER_GATEWAY_API_KEYS_FILE": str(tmp_path / "keys"),
                                     "DEEPINFER_GATEWAY_ADMIN_TOKEN": "admin-token-value"})
    assert (config.salt_key, config.api_keys, config.admin_token) == ("salt-from-file", "k1:t1,k2:t2", "admin-token-value")
    assert "salt-from-file" not in repr(config) and "admin-token-value" not in repr(config)


def test_api_keys_parse():
    assert api_keys(" k1:tA , k2:tB,") == {"k1": "tA", "k2": "tB"}
    assert api_keys("sk:with:colon:tenant") == {"sk:with:colon": "tenant"}
    assert api_keys("") == {}


def test_tenants_from_bearer_keys():
    keys = TenantKeys({"k1": "tA", "k2": "tB"}, open_access=False, salt_key="sk")
    assert keys.tenant_for("Bearer k1").name == "tA"
    assert keys.tenant_for("bearer  k2 ").name == "tB"
    for header in (None, "", "Bearer", "Basic k1", "Bearer k3"):
        with pytest.raises(OpenAIError) as caught:
            keys.tenant_for(header)
        assert caught.value.status == 401


def test_open_access_falls_back_to_the_public_tenant():
    keys = TenantKeys({"k1": "tA"}, open_access=True, salt_key="sk")
    assert keys.tenant_for(None).name == PUBLIC_TENANT
    assert keys.tenant_for("Bearer k1").name == "tA"


def test_salts_are_stable_distinct_hex_and_keyed():
    assert tenant_salt("sk", "tA") == tenant_salt("sk", "tA") != tenant_salt("sk", "tB")
    assert len(tenant_salt("sk", "tA")) == 32 and int(tenant_salt("sk", "tA"), 16) >= 0
    # Not computable from the tenant's name alone: another key, another salt; the old public hash is gone.
    assert tenant_salt("sk", "tA") != tenant_salt("other", "tA")
    public = hashlib.blake2b(b"tA", digest_size=16, person=b"dikv-tenant").hexdigest()
    assert public not in (tenant_salt("sk", "tA"), tenant_salt("", "tA"))
    keys = TenantKeys({"k1": "tA"}, open_access=False, salt_key="sk")
    assert keys.tenant_for("Bearer k1").salt == tenant_salt("sk", "tA")
    # Without a configured key, a random one per process: still not the name's public hash.
    assert TenantKeys({"k1": "tA"}, False).tenant_for("Bearer k1").salt != TenantKeys({"k1": "tA"}, False).tenant_for(
        "Bearer k1").salt


def test_admin_token():
    assert admin_allowed("Bearer s3cret", "s3cret")
    assert not admin_allowed("Bearer s3cret", "")
    assert not admin_allowed("Bearer nope", "s3cret") and not admin_allowed(None, "s3cret")
