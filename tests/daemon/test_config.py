"""Config precedence and validation: every bad value names its key."""

from __future__ import annotations

import pytest

from hisparse.daemon.conf import config
from hisparse.daemon.conf.config import ConfigError

EXAMPLE = "systemd/hisparsed.toml"


def test_the_clients_socket_variable_places_an_unconfigured_daemon(monkeypatch, tmp_path):
    monkeypatch.setenv("HISPARSE_SOCKET", str(tmp_path / "x.sock"))
    assert config.build(env={}).socket == str(tmp_path / "x.sock")
    assert config.build(env={"HISPARSED_SOCKET": "/tmp/y.sock"}).socket == "/tmp/y.sock"
    assert config.build(EXAMPLE, env={}).socket == config.SYSTEM_SOCKET


def test_embedded_defaults_need_no_root(monkeypatch, tmp_path):
    monkeypatch.delenv("HISPARSE_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    cfg = config.build(env={})
    assert cfg.socket == str(tmp_path / "hisparsed" / "hisparsed.sock")
    assert cfg.lease_ttl_s == 10.0 and cfg.shm_dir == "/dev/shm"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert "/hisparsed-" in config.build(env={}).socket


def test_example_file_parses():
    cfg = config.build(EXAMPLE, env={})
    assert cfg.socket == config.SYSTEM_SOCKET
    assert cfg.capacity_bytes == 512 << 30
    assert cfg.namespaces["glm-5.3/fp8_ds_mla/tp8"].capacity_bytes == 384 << 30


def test_flags_beat_env_beat_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('capacity = "1GiB"\nlease_ttl = 5\n')
    env = {"HISPARSED_CAPACITY": "2GiB", "HISPARSED_LEASE_TTL": "3"}
    cfg = config.build(str(f), env=env, flags={"capacity": "512MiB"})
    assert cfg.capacity_bytes == 512 << 20 and cfg.lease_ttl_s == 3.0


@pytest.mark.parametrize("text, key", [
    ('capasity = "1GiB"', "capasity"),
    ('capacity = "lots"', "capacity"),
    ("lease_ttl = 0.5", "lease_ttl"),
    ('log_level = "LOUD"', "log_level"),
    ('[namespaces."m"]\nsize = 1', 'namespaces."m".size'),
    ('[namespaces."m"]', 'namespaces."m".capacity'),
    ("capacity = ", "c.toml"),
])
def test_bad_values_name_their_key(tmp_path, text, key):
    f = tmp_path / "c.toml"
    f.write_text(text + "\n")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config.build(str(f), env={})


def test_bad_env_names_the_key():
    with pytest.raises(ConfigError, match="lease_ttl"):
        config.build(env={"HISPARSED_LEASE_TTL": "soon"})


def test_reload_takes_only_live_keys(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('lease_ttl = 5\ncapacity = "1GiB"\n')
    cfg = config.build(str(f), env={})
    f.write_text('lease_ttl = 2\ncapacity = "9GiB"\nlog_level = "debug"\n')
    new = config.reload(cfg)
    assert new.lease_ttl_s == 2.0 and new.log_level == "DEBUG"
    assert new.capacity_bytes == 1 << 30, "capacity cannot change live"


def test_metrics_address_forms(tmp_path):
    sock = str(tmp_path / "run" / "hisparsed.sock")
    # default: a unix socket beside the daemon's; "" turns it off; a path or HOST:PORT otherwise
    assert config.build(env={}, flags={"socket": sock}).metrics_endpoint == str(tmp_path / "run" / "hisparsed.metrics.sock")
    assert config.build(env={"HISPARSED_METRICS_ADDRESS": ""}).metrics_endpoint == ""
    assert config.build(env={}, flags={"metrics_address": "127.0.0.1:9477"}).metrics_endpoint == "127.0.0.1:9477"
    assert config.build(env={}, flags={"metrics_address": "[::1]:9477"}).metrics_endpoint == "[::1]:9477"
    assert config.build(env={}, flags={"metrics_address": "/run/m.sock"}).metrics_endpoint == "/run/m.sock"
    # the shipped config keeps the 0600 unix socket beside the daemon's (issue 20)
    assert config.build(EXAMPLE, env={}).metrics_endpoint == "/run/hisparsed/hisparsed.metrics.sock"
    for bad in ("9477", "localhost", "127.0.0.1:99999", "host:port"):
        with pytest.raises(ConfigError, match="metrics_address"):
            config.build(env={}, flags={"metrics_address": bad})
    f = tmp_path / "c.toml"
    f.write_text("metrics_address = 9477\n")
    with pytest.raises(ConfigError, match="metrics_address: must be a string"):
        config.build(str(f), env={})


def test_a_metrics_socket_path_too_long_for_unix_sockets(tmp_path):
    deep = "/tmp/" + "d" * 80 + "/hisparsed.sock"  # fits; the metrics socket beside it would not
    assert config.build(env={}, flags={"socket": deep}).metrics_endpoint == ""
    with pytest.raises(ConfigError, match="longer than a unix socket path"):
        config.build(env={}, flags={"metrics_address": "/tmp/" + "m" * 110 + ".sock"})


def test_the_example_documents_every_key():
    import re

    text = open(EXAMPLE).read()
    for key in [*config._KEYS, "group"]:
        assert re.search(rf"^(# )?{key} = ", text, re.M), f"{EXAMPLE} does not document {key}"
    cfg = config.build(EXAMPLE, env={})
    assert cfg.session_pin_share == 0.5 and cfg.session_reserve_share == 0.5
def test_cluster_section_is_off_by_default_and_parsed_with_env_overrides(tmp_path):
    assert not config.build(env={}).cluster.enabled
    f = tmp_path / "c.toml"
    f.write_text('[cluster]\nbackend = "mooncake"\nmaster = "10.0.0.1:50051"\nsegment_size = "4GiB"\n'
                 'replicas = 2\nwrite_policy = "on-evict"\n')
    cfg = config.build(str(f), env={"HISPARSED_CLUSTER_REPLICAS": "3", "HISPARSED_CLUSTER_TIMEOUT": "0.5"})
    c = cfg.cluster
    assert c.enabled and c.master == "10.0.0.1:50051" and c.segment_size_bytes == 4 << 30
    assert c.replicas == 3 and c.timeout_s == 0.5 and c.write_policy == "on-evict"
    assert "cluster=mooncake" in cfg.summary()
    # env alone turns it on
    assert config.build(env={"HISPARSED_CLUSTER_BACKEND": "mooncake"}).cluster.enabled


@pytest.mark.parametrize(("text", "names"), [
    ('[cluster]\nbackend = "redis"\n', "cluster.backend"),
    ('[cluster]\nwrite_policy = "never"\n', "cluster.write_policy"),
    ('[cluster]\nreplicas = 0\n', "cluster.replicas"),
    ('[cluster]\nprotocol = "udp"\n', "cluster.protocol"),
    ('[cluster]\nbogus = 1\n', "cluster.bogus"),
    ('[cluster]\nbackend = "mooncake"\nmaster = "nohost"\n', "cluster.master"),
    ('[cluster]\nbackend = "mooncake"\nprotocol = "rdma"\n', "cluster.rdma_devices"),
    ('cluster = 3\n', "cluster"),
])
def test_bad_cluster_values_name_their_key(tmp_path, text, names):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=names):
        config.build(str(f), env={})


def test_the_example_file_documents_every_cluster_key():
    with open(EXAMPLE) as f:
        text = f.read()
    for key in config._CLUSTER_KEYS:
        assert f"# {key} = " in text or f"\n{key} = " in text, key


CAP_FLAGS = {"--max-sessions": ("max_sessions", "12", 12),
             "--max-sessions-per-connection": ("max_sessions_per_connection", "3", 3),
             "--max-sessions-per-uid": ("max_sessions_per_uid", "7", 7),
             "--max-connections": ("max_connections", "9", 9),
             "--max-connections-per-uid": ("max_connections_per_uid", "4", 4),
             "--fd-headroom": ("fd_headroom", "0", 0),
             "--max-request-bytes-in-flight": ("max_request_bytes_in_flight", "64MiB", 64 << 20)}


def test_every_key_is_a_flag_and_the_caps_flags_reach_the_config(tmp_path):
    from hisparse.daemon import main

    assert set(main.flags_of(main.parse_args([]))) == set(config._KEYS)
    argv = [part for flag, (_, text, _) in CAP_FLAGS.items() for part in (flag, text)]
    f = tmp_path / "c.toml"
    f.write_text("max_sessions = 100\nmax_connections = 100\n")
    env = {"HISPARSED_MAX_SESSIONS": "50", "HISPARSED_MAX_CONNECTIONS_PER_UID": "50"}
    cfg = config.build(str(f), env=env, flags=main.flags_of(main.parse_args(argv)))
    for field, _, value in CAP_FLAGS.values():
        assert getattr(cfg, field) == value, field  # flags beat env beat file
    with pytest.raises(ConfigError, match="max_connections"):
        config.build(env={}, flags=main.flags_of(main.parse_args(["--max-connections", "0"])))


def test_the_caps_take_a_restart(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("max_sessions = 100\nfd_headroom = 64\n")
    cfg = config.build(str(f), env={})
    f.write_text("max_sessions = 5\nfd_headroom = 8\n")
    new = config.reload(cfg)
    assert (new.max_sessions, new.fd_headroom) == (100, 64)
    assert not set(config.RELOADABLE) & {field for _, (field, _, _) in CAP_FLAGS.items()}
