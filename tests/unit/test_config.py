"""Unit tests for kvstore.config: defaults, YAML file, environment, overrides, size parsing."""

from __future__ import annotations

import dataclasses

import pytest

from kvstore.config import (
    ClientConfig,
    Config,
    DaemonConfig,
    LogConfig,
    MetaConfig,
    default_host_id,
    load_config,
    parse_size,
)
from kvstore.errors import InvalidArgument
from kvstore.tls import TlsConfig

GiB = 1 << 30
MiB = 1 << 20


def write_yaml(tmp_path, text: str):
    p = tmp_path / "kvstore.yaml"
    p.write_text(text)
    return p


# ---- defaults -----------------------------------------------------------------------------------


def test_defaults_without_any_source():
    cfg = load_config(env={})
    assert cfg == Config()
    assert cfg.meta.listen == "127.0.0.1:7100"
    assert cfg.meta.max_batch_keys == 16384
    assert cfg.meta.max_block_bytes == GiB
    assert cfg.meta.put_timeout_s == 30.0
    assert cfg.meta.daemon_ttl_s == 3.0
    assert cfg.meta.allow_clock_skew is False
    assert cfg.daemon.dram_bytes == GiB
    assert cfg.daemon.meta == "127.0.0.1:7100"
    assert cfg.client.transport == "auto"
    assert cfg.client.retries == 2
    assert cfg.log.level == "info"


def test_config_sections_are_independent_instances():
    a, b = load_config(env={}), load_config(env={})
    a.daemon.dram_bytes = 5
    assert b.daemon.dram_bytes == GiB


def test_default_host_id_is_stable_and_nonempty():
    assert default_host_id() == default_host_id()
    assert default_host_id()


# ---- YAML file ----------------------------------------------------------------------------------


def test_yaml_file(tmp_path):
    p = write_yaml(
        tmp_path,
        """
meta:
  listen: 0.0.0.0:9000
  max_batch_keys: 100
  put_timeout_s: 2.5
  allow_clock_skew: true
daemon:
  dram_bytes: 512MiB
  data_dir: /tmp/x
client:
  transport: tcp
  retries: 5
log:
  level: debug
""",
    )
    cfg = load_config(p, env={})
    assert cfg.meta.listen == "0.0.0.0:9000"
    assert cfg.meta.max_batch_keys == 100
    assert cfg.meta.put_timeout_s == 2.5
    assert cfg.meta.allow_clock_skew is True
    assert cfg.daemon.dram_bytes == 512 * MiB
    assert cfg.daemon.data_dir == "/tmp/x"
    assert cfg.client.transport == "tcp"
    assert cfg.client.retries == 5
    assert cfg.log.level == "debug"
    # Untouched keys keep their defaults.
    assert cfg.meta.lease_ttl_s == MetaConfig().lease_ttl_s
    assert cfg.daemon.shm_dir == DaemonConfig().shm_dir


def test_yaml_file_accepts_str_path(tmp_path):
    p = write_yaml(tmp_path, "daemon:\n  dram_bytes: 1024\n")
    assert load_config(str(p), env={}).daemon.dram_bytes == 1024


def test_yaml_int_for_float_field_is_coerced(tmp_path):
    p = write_yaml(tmp_path, "meta:\n  lease_ttl_s: 4\n")
    cfg = load_config(p, env={})
    assert cfg.meta.lease_ttl_s == 4.0 and isinstance(cfg.meta.lease_ttl_s, float)


def test_empty_yaml_file_gives_defaults(tmp_path):
    p = write_yaml(tmp_path, "")
    assert load_config(p, env={}) == Config()


def test_config_path_from_env(tmp_path):
    p = write_yaml(tmp_path, "log:\n  level: warning\n")
    cfg = load_config(env={"KVSTORE_CONFIG": str(p)})
    assert cfg.log.level == "warning"


def test_explicit_path_beats_env_config_path(tmp_path):
    p1 = write_yaml(tmp_path, "log:\n  level: warning\n")
    p2 = tmp_path / "other.yaml"
    p2.write_text("log:\n  level: error\n")
    cfg = load_config(p2, env={"KVSTORE_CONFIG": str(p1)})
    assert cfg.log.level == "error"


def test_missing_file_is_invalid_argument_naming_it(tmp_path):
    p = tmp_path / "nope.yaml"
    with pytest.raises(InvalidArgument, match="nope.yaml"):
        load_config(p, env={})


def test_yaml_top_level_not_a_mapping(tmp_path):
    p = write_yaml(tmp_path, "- a\n- b\n")
    with pytest.raises(InvalidArgument, match="mapping of sections"):
        load_config(p, env={})


def test_yaml_section_not_a_mapping(tmp_path):
    p = write_yaml(tmp_path, "daemon: 5\n")
    with pytest.raises(InvalidArgument, match="'daemon' must be a mapping"):
        load_config(p, env={})


def test_malformed_yaml_is_invalid_argument(tmp_path):
    p = write_yaml(tmp_path, "daemon:\n  dram_bytes: [1, 2\n")
    with pytest.raises(InvalidArgument, match="kvstore.yaml"):
        load_config(p, env={})


# ---- environment --------------------------------------------------------------------------------


def test_env_var_sets_size():
    cfg = load_config(env={"KVSTORE_DAEMON__DRAM_BYTES": "2GiB"})
    assert cfg.daemon.dram_bytes == 2 * GiB


def test_env_vars_several_sections_and_types():
    cfg = load_config(
        env={
            "KVSTORE_META__LISTEN": "10.0.0.1:1",
            "KVSTORE_META__ALLOW_CLOCK_SKEW": "yes",
            "KVSTORE_META__DAEMON_TTL_S": "2.5",
            "KVSTORE_CLIENT__RETRIES": "7",
            "KVSTORE_LOG__LEVEL": "error",
        }
    )
    assert cfg.meta.listen == "10.0.0.1:1"
    assert cfg.meta.allow_clock_skew is True
    assert cfg.meta.daemon_ttl_s == 2.5
    assert cfg.client.retries == 7
    assert cfg.log.level == "error"


def test_env_var_names_are_case_insensitive_after_prefix():
    cfg = load_config(env={"KVSTORE_Daemon__Dram_Bytes": "1MiB"})
    assert cfg.daemon.dram_bytes == MiB


def test_unrelated_env_vars_are_ignored():
    cfg = load_config(
        env={"PATH": "/bin", "KVSTORE_SOMETHING": "x", "OTHER__X": "1", "kvstore_daemon__dram_bytes": "1"}
    )
    assert cfg == Config()


def test_env_os_environ_used_by_default(monkeypatch):
    monkeypatch.setenv("KVSTORE_DAEMON__DRAM_BYTES", "3MiB")
    monkeypatch.delenv("KVSTORE_CONFIG", raising=False)
    assert load_config().daemon.dram_bytes == 3 * MiB


# ---- overrides ----------------------------------------------------------------------------------


def test_override_sets_size():
    cfg = load_config(overrides=["daemon.dram_bytes=512MiB"], env={})
    assert cfg.daemon.dram_bytes == 512 * MiB


def test_overrides_apply_in_order_last_wins():
    cfg = load_config(overrides=["client.retries=1", "client.retries=9"], env={})
    assert cfg.client.retries == 9


def test_override_value_may_contain_equals_and_spaces():
    cfg = load_config(overrides=[" meta.listen =a=b", "meta.allow_clock_skew= on"], env={})
    assert cfg.meta.listen == "a=b"
    assert cfg.meta.allow_clock_skew is True


@pytest.mark.parametrize("item", ["daemon.dram_bytes", "dram_bytes=1", "=1", "daemon=1"])
def test_malformed_override_refused(item):
    with pytest.raises(InvalidArgument, match="section.key=value"):
        load_config(overrides=[item], env={})


# ---- precedence ---------------------------------------------------------------------------------


def test_precedence_file_then_env_then_override(tmp_path):
    p = write_yaml(tmp_path, "daemon:\n  dram_bytes: 1MiB\n  data_dir: /from/file\n  shm_dir: /file/shm\n")
    env = {"KVSTORE_DAEMON__DRAM_BYTES": "2MiB", "KVSTORE_DAEMON__DATA_DIR": "/from/env"}
    cfg = load_config(p, overrides=["daemon.dram_bytes=3MiB"], env=env)
    assert cfg.daemon.dram_bytes == 3 * MiB  # override beats env and file
    assert cfg.daemon.data_dir == "/from/env"  # env beats file
    assert cfg.daemon.shm_dir == "/file/shm"  # file beats default
    assert cfg.daemon.host == DaemonConfig().host  # default


def test_env_beats_file(tmp_path):
    p = write_yaml(tmp_path, "log:\n  level: debug\n")
    assert load_config(p, env={"KVSTORE_LOG__LEVEL": "error"}).log.level == "error"


# ---- unknown names, from each source ------------------------------------------------------------


def test_unknown_section_in_file(tmp_path):
    p = write_yaml(tmp_path, "deamon:\n  dram_bytes: 1\n")
    with pytest.raises(InvalidArgument, match="unknown config section 'deamon'") as ei:
        load_config(p, env={})
    assert "config file" in str(ei.value)


def test_unknown_key_in_file(tmp_path):
    p = write_yaml(tmp_path, "daemon:\n  dram_byte: 1\n")
    with pytest.raises(InvalidArgument, match=r"unknown config key daemon\.dram_byte") as ei:
        load_config(p, env={})
    assert "config file" in str(ei.value)


def test_unknown_section_in_env():
    with pytest.raises(InvalidArgument, match="unknown config section 'bogus'") as ei:
        load_config(env={"KVSTORE_BOGUS__X": "1"})
    assert "KVSTORE_BOGUS__X" in str(ei.value)


def test_unknown_key_in_env():
    with pytest.raises(InvalidArgument, match=r"unknown config key meta\.nope") as ei:
        load_config(env={"KVSTORE_META__NOPE": "1"})
    assert "KVSTORE_META__NOPE" in str(ei.value)


def test_unknown_section_in_override():
    with pytest.raises(InvalidArgument, match="unknown config section 'server'") as ei:
        load_config(overrides=["server.port=1"], env={})
    assert "override" in str(ei.value)


def test_unknown_key_in_override():
    with pytest.raises(InvalidArgument, match=r"unknown config key client\.transprt"):
        load_config(overrides=["client.transprt=tcp"], env={})


def test_error_lists_known_names():
    with pytest.raises(InvalidArgument) as ei:
        load_config(overrides=["log.lvl=debug"], env={})
    assert "level" in str(ei.value)
    with pytest.raises(InvalidArgument) as ei:
        load_config(overrides=["x.y=1"], env={})
    for name in ("meta", "daemon", "client", "log"):
        assert name in str(ei.value)


def test_every_field_is_settable_by_override():
    for section_cls, section in (
        (MetaConfig, "meta"),
        (DaemonConfig, "daemon"),
        (ClientConfig, "client"),
        (LogConfig, "log"),
        (TlsConfig, "tls"),
    ):
        for f in dataclasses.fields(section_cls):
            # Keys with a range or a set of choices get a value inside it.
            value, want = SPECIAL.get(
                f"{section}.{f.name}",
                {"int": ("3", 3), "float": ("1.5", 1.5), "bool": ("true", True), "str": ("v", "v")}[f.type],
            )
            cfg = load_config(overrides=[f"{section}.{f.name}={value}"], env={})
            got = getattr(getattr(cfg, section), f.name)
            assert got == want, (section, f.name)


SPECIAL = {
    "meta.dram_high_watermark": ("0.95", 0.95),
    "meta.dram_low_watermark": ("0.15", 0.15),
    "meta.cache_policy": ("lru", "lru"),
    "daemon.ssd_durability": ("durable", "durable"),
    "daemon.ssd_compress": ("off", "off"),
    "client.transport": ("tcp", "tcp"),
    "log.level": ("debug", "debug"),
    "log.format": ("json", "json"),
    "tls.ca": ("", ""),  # files are checked: the TLS tests set real ones
    "tls.cert": ("", ""),
    "tls.key": ("", ""),
}


@pytest.mark.parametrize(
    ("items", "match"),
    [
        (
            ["meta.heartbeat_interval_s=5", "meta.daemon_ttl_s=3"],
            "meta.heartbeat_interval_s .* must be below meta.daemon_ttl_s",
        ),
        (
            ["meta.dram_low_watermark=0.9", "meta.dram_high_watermark=0.8"],
            "meta.dram_low_watermark .* must be below meta.dram_high_watermark",
        ),
        (["meta.dram_high_watermark=1.5"], "meta.dram_high_watermark: must be a fraction"),
        (["meta.dram_low_watermark=nan"], "meta.dram_low_watermark: must be a fraction"),
        (["meta.lease_ttl_s=0"], "meta.lease_ttl_s: must be positive"),
        (["meta.put_timeout_s=inf"], "meta.put_timeout_s: must be a finite number"),
        (["meta.max_batch_keys=-1"], "meta.max_batch_keys: must be positive"),
        (["meta.daemon_rpc_timeout_s=-2"], "meta.daemon_rpc_timeout_s: must be positive"),
        (["daemon.dram_bytes=0"], "daemon.dram_bytes: must be positive"),
        (["daemon.data_port=70000"], "daemon.data_port: must be a port number"),
        (["daemon.ssd_durability=sometimes"], "daemon.ssd_durability: must be one of fast, durable"),
        (["meta.cache_policy=random"], "meta.cache_policy: must be one of adaptive, lru"),
        (["client.transport=carrier-pigeon"], "client.transport: must be one of auto, shm, tcp"),
        (["client.io_threads=0"], "client.io_threads: must be positive"),
        (["client.retries=-1"], "client.retries: must be >= 0"),
        (["log.level=loud"], "log.level: must be one of"),
        (["log.format=xml"], "log.format: must be one of text, json"),
        (["meta.metrics_port=-2"], "meta.metrics_port: must be -1 .off."),
        (["daemon.metrics_port=65536"], "daemon.metrics_port: must be -1 .off."),
        (["daemon.drain_timeout_s=-1"], "daemon.drain_timeout_s: must be >= 0"),
        (["daemon.ticket_skew_s=31"], "daemon.ticket_skew_s: must be between 0 and 30"),
        (["daemon.ticket_skew_s=-1"], "daemon.ticket_skew_s: must be between 0 and 30"),
    ],
)
def test_ranges_and_relations_are_checked_at_load_naming_the_key(items, match):
    with pytest.raises(InvalidArgument, match=match):
        load_config(overrides=items, env={})


# ---- bad values ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("item", "name"),
    [
        ("meta.max_batch_keys=many", "meta.max_batch_keys"),
        ("meta.max_batch_keys=1.5", "meta.max_batch_keys"),
        ("meta.put_timeout_s=soon", "meta.put_timeout_s"),
        ("meta.allow_clock_skew=maybe", "meta.allow_clock_skew"),
        ("daemon.dram_bytes=lots", "daemon.dram_bytes"),
        ("daemon.dram_bytes=12XB", "daemon.dram_bytes"),
        ("daemon.dram_bytes=-1GiB", "daemon.dram_bytes"),
        ("daemon.dram_bytes=", "daemon.dram_bytes"),
        ("client.retries=two", "client.retries"),
        ("daemon.data_port=", "daemon.data_port"),
    ],
)
def test_bad_value_in_override_names_the_key(item, name):
    with pytest.raises(InvalidArgument, match=name.replace(".", r"\.")):
        load_config(overrides=[item], env={})


def test_bad_value_in_env_names_the_key():
    with pytest.raises(InvalidArgument, match=r"meta\.lease_ttl_s"):
        load_config(env={"KVSTORE_META__LEASE_TTL_S": "ten"})


@pytest.mark.parametrize(
    "text",
    [
        "daemon:\n  dram_bytes: true\n",
        "daemon:\n  dram_bytes: [1, 2]\n",
        "meta:\n  max_batch_keys: [1]\n",
        "meta:\n  put_timeout_s: {a: 1}\n",
        "meta:\n  allow_clock_skew: 2\n",
    ],
)
def test_bad_value_type_in_file(tmp_path, text):
    p = write_yaml(tmp_path, text)
    with pytest.raises(InvalidArgument):
        load_config(p, env={})


def test_list_for_str_field_refused(tmp_path):
    p = write_yaml(tmp_path, "meta:\n  listen: [a, b]\n")
    with pytest.raises(InvalidArgument, match=r"meta\.listen"):
        load_config(p, env={})


def test_bool_for_int_field_refused(tmp_path):
    p = write_yaml(tmp_path, "daemon:\n  data_port: true\n")
    with pytest.raises(InvalidArgument, match=r"daemon\.data_port"):
        load_config(p, env={})


def test_float_for_int_field_refused(tmp_path):
    p = write_yaml(tmp_path, "client:\n  retries: 2.7\n")
    with pytest.raises(InvalidArgument, match=r"client\.retries"):
        load_config(p, env={})


def test_negative_size_in_file_refused(tmp_path):
    p = write_yaml(tmp_path, "daemon:\n  dram_bytes: -1\n")
    with pytest.raises(InvalidArgument, match=r"daemon\.dram_bytes"):
        load_config(p, env={})


# ---- parse_size ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", 0),
        ("123", 123),
        ("123b", 123),
        ("1k", 1000),
        ("1KB", 1000),
        ("1KiB", 1024),
        ("1ki", 1024),
        ("2M", 2 * 10**6),
        ("2MB", 2 * 10**6),
        ("512MiB", 512 * MiB),
        ("512mib", 512 * MiB),
        ("2GiB", 2 * GiB),
        ("2gi", 2 * GiB),
        ("1.5GB", 1_500_000_000),
        ("1.5GiB", 3 * GiB // 2),
        ("0.5KiB", 512),
        (".5KiB", 512),
        ("1T", 10**12),
        ("1TiB", 1 << 40),
        (" 4 MiB ", 4 * MiB),
        (4096, 4096),
    ],
)
def test_parse_size(text, value):
    got = parse_size(text)
    assert got == value
    assert isinstance(got, int)


@pytest.mark.parametrize("text", ["", "abc", "1XB", "1 G B", "GiB", "1.2.3", "-1", "1e9", "1PiB", True, False, None])
def test_parse_size_refuses(text):
    with pytest.raises(InvalidArgument, match="dram_bytes"):
        parse_size(text, "dram_bytes")


def test_client_settings_come_from_the_environment(monkeypatch, tmp_path):
    from kvstore.certs import make
    from kvstore.config import client_settings

    make(tmp_path, ("client",))
    monkeypatch.setenv("KVSTORE_CLIENT__TOKEN", "tenant-a-token-0123456789")
    monkeypatch.setenv("KVSTORE_TLS__CA", str(tmp_path / "ca.pem"))
    monkeypatch.setenv("KVSTORE_TLS__CERT", str(tmp_path / "client.pem"))
    monkeypatch.setenv("KVSTORE_TLS__KEY", str(tmp_path / "client.key"))
    cc, tls = client_settings(rpc_timeout_s=2, retries=0)
    assert cc.token == "tenant-a-token-0123456789" and cc.rpc_timeout_s == 2 and cc.retries == 0
    assert tls.enabled and tls.cert.endswith("client.pem")


def test_either_cache_policy_loads_and_another_is_refused():
    assert load_config(overrides=["meta.cache_policy=lru"], env={}).meta.cache_policy == "lru"
    assert load_config(env={}).meta.cache_policy == "adaptive"
    with pytest.raises(InvalidArgument, match="meta.cache_policy"):
        load_config(overrides=["meta.cache_policy=lfu"], env={})
    with pytest.raises(InvalidArgument, match="meta.index"):  # one index: the setting is gone
        load_config(overrides=["meta.index=compact"], env={})
