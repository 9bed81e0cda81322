"""GatewayConfig from flags and environment; API keys -> tenants and their salts."""
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
           "DEEPINFER_GATEWAY_TOKENIZER_JSON": "/tmp/t.json"}
    config = GatewayConfig.load(["--port", "9002", "--api-keys", "k1:t1"], env)
    assert config.port == 9002 and config.api_keys == "k1:t1"
    assert config.engines == ["http://a:1", "http://b:2"] and config.open_access
    assert config.lookup_timeout_s == 0.25 and config.tokenizer_json == "/tmp/t.json"
    flags = GatewayConfig.load(["--engine", "http://c:3", "--engine", "http://d:4",
                                "--no-open-access"], env)
    assert flags.engines == ["http://c:3", "http://d:4"] and not flags.open_access


@pytest.mark.parametrize("argv, env", [
    (["--port", "0"], {}), (["--engine", "a:1"], {}), (["--api-keys", "nokey"], {}),
    ([], {"DEEPINFER_GATEWAY_OPEN_ACCESS": "maybe"}), (["--lookup-timeout-s", "0"], {}),
    (["--default-max-tokens", "0"], {}), (["--port", "eighty"], {})])
def test_bad_values_fail_at_startup(argv, env):
    with pytest.raises(ConfigError):
        GatewayConfig.load(argv, env)


def test_api_keys_parse():
    assert api_keys(" k1:tA , k2:tB,") == {"k1": "tA", "k2": "tB"}
    assert api_keys("sk:with:colon:tenant") == {"sk:with:colon": "tenant"}
    assert api_keys("") == {}


def test_tenants_from_bearer_keys():
    keys = TenantKeys({"k1": "tA", "k2": "tB"}, open_access=False)
    assert keys.tenant_for("Bearer k1").name == "tA"
    assert keys.tenant_for("bearer  k2 ").name == "tB"
    for header in (None, "", "Bearer", "Basic k1", "Bearer k3"):
        with pytest.raises(OpenAIError) as caught:
            keys.tenant_for(header)
        assert caught.value.status == 401


def test_open_access_falls_back_to_the_public_tenant():
    keys = TenantKeys({"k1": "tA"}, open_access=True)
    assert keys.tenant_for(None).name == PUBLIC_TENANT
    assert keys.tenant_for("Bearer k1").name == "tA"


def test_salts_are_stable_distinct_hex():
    assert tenant_salt("tA") == tenant_salt("tA") != tenant_salt("tB")
    assert len(tenant_salt("tA")) == 32 and int(tenant_salt("tA"), 16) >= 0


def test_admin_token():
    assert admin_allowed("Bearer s3cret", "s3cret")
    assert not admin_allowed("Bearer s3cret", "")
    assert not admin_allowed("Bearer nope", "s3cret") and not admin_allowed(None, "s3cret")
