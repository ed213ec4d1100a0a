"""ebpo.serve.cli: the `ebpo serve` command line (the API key from the environment, which hosts are loopback,
settings refused before anything loads). The served behaviour is in test_serve.py, test_app.py and test_service.py."""
import pytest


def test_the_api_key_comes_from_the_environment_unless_given(monkeypatch):
    from ebpo.serve.cli import build_parser

    monkeypatch.setenv("EBPO_API_KEY", "from-env")
    assert build_parser().parse_args([]).api_key == "from-env"
    assert build_parser().parse_args(["--api-key", "given"]).api_key == "given"
    monkeypatch.delenv("EBPO_API_KEY")
    assert build_parser().parse_args([]).api_key is None


@pytest.mark.parametrize("host, local", [("127.0.0.1", True), ("127.3.4.5", True), ("localhost", True),
                                         ("::1", True), ("0.0.0.0", False), ("::", False), ("10.1.2.3", False),
                                         ("myhost.example", False)])
def test_which_hosts_are_loopback(host, local):
    from ebpo.serve.cli import is_loopback

    assert is_loopback(host) is local


def test_the_serve_command_refuses_a_bad_setting_before_loading_anything(capsys):
    from ebpo.cli import main

    assert main(["serve", "--set", "tau_mask=3"]) == 2
    assert "tau_mask" in capsys.readouterr().err


def test_the_defaults_are_the_documented_ones(monkeypatch):
    from ebpo.serve.cli import build_parser

    monkeypatch.delenv("EBPO_API_KEY", raising=False)
    args = build_parser().parse_args([])
    # docs/serving.md: 127.0.0.1:8000, no key; "the defaults, spelled out": 4 MiB, 10 s grace, 16 rows; the module's
    # docstring and --help: tiny-agent, the quality preset, 1024 tokens, cpu, torch's own thread count
    assert vars(args) == {"model": "tiny-agent", "name": None, "host": "127.0.0.1", "port": 8000, "mode": "quality",
                          "set": [], "max_batch": 16, "max_sequences": None, "max_len": 1024, "device": "cpu",
                          "num_threads": 0, "api_key": None, "max_body_mb": 4.0, "shutdown_grace_s": 10.0}
    monkeypatch.setenv("EBPO_API_KEY", "")  # an empty variable is no key
    assert build_parser().parse_args([]).api_key is None
    typed = build_parser().parse_args(["--port", "9", "--max-batch", "3", "--max-sequences", "5", "--max-len", "64",
                                       "--num-threads", "2", "--max-body-mb", "0.5", "--shutdown-grace-s", "1.5",
                                       "--set", "a=1", "--set", "b=2", "--mode", "speed", "--name", "n"])
    assert (typed.port, typed.max_batch, typed.max_sequences, typed.max_len, typed.num_threads) == (9, 3, 5, 64, 2)
    assert (typed.max_body_mb, typed.shutdown_grace_s, typed.set) == (0.5, 1.5, ["a=1", "b=2"])
    assert (typed.mode, typed.name) == ("speed", "n")


def test_the_mode_is_one_of_the_presets(capsys):
    from ebpo.serve.cli import build_parser

    for mode in ("m2t", "quality", "speed"):
        assert build_parser().parse_args(["--mode", mode]).mode == mode
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--mode", "fast"])
    assert e.value.code == 2 and "invalid choice: 'fast'" in capsys.readouterr().err


def test_the_help_is_the_documented_reference(monkeypatch):
    """docs/reference/cli.md's `ebpo serve` section is what users read: the parser's help must say the same."""
    from pathlib import Path

    from ebpo.serve.cli import build_parser

    page = (Path(__file__).resolve().parents[2] / "docs/reference/cli.md").read_text()
    section = page.split("## `ebpo serve`\n\n```text\n", 1)[1].split("\n```", 1)[0]
    monkeypatch.setenv("COLUMNS", "100")  # the width the page is written at
    assert build_parser().format_help().rstrip() == section


def test_localhost_is_loopback_in_any_case():
    from ebpo.serve.cli import is_loopback

    assert is_loopback("LocalHost") and is_loopback("LOCALHOST") and not is_loopback("localhost.example")


def test_build_service_defaults(monkeypatch):
    from ebpo.serve.cli import build_service
    from rollout.config import DecodeConfig

    service, driver = build_service("preset:tiny")
    try:
        assert service.name == "preset:tiny" and service.default == DecodeConfig.preset("quality")
        assert (driver.max_batch, driver.max_len, service.max_sequences) == (16, 1024, 64)  # 4 x max_batch
        assert not service.model.training and driver.model is service.model
    finally:
        driver.close()
    service, driver = build_service("preset:tiny", "m", "speed", {"max_new_tokens": 7, "block_size": 4}, 3, 64,
                                     "meta", 5)
    try:
        assert (service.name, service.default) == ("m", DecodeConfig.preset("speed", max_new_tokens=7, block_size=4))
        assert (driver.max_batch, driver.max_len, service.max_sequences) == (3, 64, 5)
        assert next(service.model.parameters()).device.type == "meta"  # --device
        # the default settings are the engine's own too: its block size (the preset model's is 8)
        assert service.model.config.block_size == 8 and driver.engine.K == 4
    finally:
        driver.close()


# ---- `main`, in process: the real service and app; the uvicorn server replaced by one that asks the app what a
# client would ask, so that the flags are checked by what they do

WARNING = ("ebpo serve: WARNING: listening on {} without an API key: anyone who can reach this port can run the model "
           "(set --api-key or $EBPO_API_KEY)")


@pytest.fixture()
def serve(monkeypatch, capsys):
    """main(argv) with the server replaced; returns (rc, record): record has the uvicorn config, the grace, the
    app's answers, the service and driver built, the stderr printed before the model loaded, driver closes."""
    import asyncio

    import httpx

    import ebpo.serve.app as app_mod
    import ebpo.serve.cli as cli
    import ebpo.serve.driver as driver_mod

    monkeypatch.delenv("EBPO_API_KEY", raising=False)
    rec = {"closes": [], "threads": []}
    real_build, real_close = cli.build_service, driver_mod.EngineDriver.close

    def build_service(*args):
        rec["before_load"] = capsys.readouterr().err
        rec["service"], rec["driver"] = real_build(*args)
        return rec["service"], rec["driver"]

    def close(self, timeout=10.0):
        rec["closes"].append(timeout)
        real_close(self, timeout)

    async def ask(app, key):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            models = await http.get("/v1/models", headers=headers)
            keyless = await http.get("/v1/models")
            big = {}
            for size in (rec["limit"], rec["limit"] + 1):  # bodies of exactly the limit, and one byte more
                body = b'{"model": "x", "messages": []' + b" " * (size - 30) + b"}"
                r = await http.post("/v1/chat/completions", content=body,
                                    headers={**headers, "Content-Type": "application/json"})
                big[len(body)] = r.status_code
        return {"models": (models.status_code, models.json()), "keyless": keyless.status_code, "bodies": big}

    class Server:
        def __init__(self, config, grace_s):
            rec["config"], rec["grace_s"] = config, grace_s

        def run(self):
            if rec.get("fail"):
                raise RuntimeError("port in use")
            rec["answers"] = asyncio.run(ask(self.config_app(), rec.get("key")))

        @staticmethod
        def config_app():
            return rec["config"].app

    monkeypatch.setattr(app_mod, "GracefulServer", Server)
    monkeypatch.setattr(cli, "build_service", build_service)
    monkeypatch.setattr(driver_mod.EngineDriver, "close", close)
    import torch

    monkeypatch.setattr(torch, "set_num_threads", rec["threads"].append)

    def run(argv, key=None, limit=4 * 2 ** 20, fail=False):
        rec.update(key=key, limit=limit, fail=fail)
        return cli.main(argv), rec

    run.rec = rec
    return run


def test_main_serves_the_model_with_its_flags(serve, capsys):
    from rollout.config import DecodeConfig

    argv = ["--model", "preset:tiny", "--name", "served", "--host", "0.0.0.0", "--port", "8123", "--mode", "speed",
            "--set", "max_new_tokens=7", "--set", "tau_edit=0.3", "--max-batch", "3", "--max-len", "64",
            "--api-key", "sekret", "--max-body-mb", "0.001", "--shutdown-grace-s", "2.5", "--num-threads", "2",
            "--device", "meta"]
    rc, rec = serve(argv, key="sekret", limit=int(0.001 * 2 ** 20))
    assert rc == 0 and "WARNING" not in rec["before_load"]  # a key: no warning beyond loopback
    config = rec["config"]
    assert (config.host, config.port, config.log_level, rec["grace_s"]) == ("0.0.0.0", 8123, "warning", 2.5)
    service, driver = rec["service"], rec["driver"]
    assert service.name == "served" and service.default == DecodeConfig.preset("speed", max_new_tokens=7, tau_edit=0.3)
    assert (driver.max_batch, driver.max_len, service.max_sequences) == (3, 64, 12)
    assert rec["threads"] == [2] and next(service.model.parameters()).device.type == "meta"
    answers = rec["answers"]
    assert answers["models"][0] == 200 and [m["id"] for m in answers["models"][1]["data"]] == ["served"]
    assert answers["keyless"] == 401  # the key guards every route
    assert answers["bodies"] == {1048: 400, 1049: 413}  # 0.001 MiB = 1048 bytes; the one at the limit is read
    assert rec["closes"] == [2.0]  # the engine thread is stopped when the server returns
    assert capsys.readouterr().err == ("ebpo serve: 'served' on http://0.0.0.0:8123/v1 (max_batch 3, max_sequences 12, "
                                       "max_len 64, default speed, API key required)\n")


@pytest.mark.parametrize("host, key, env, warned", [("0.0.0.0", None, None, True), ("10.1.2.3", None, None, True),
                                                    ("::1", None, None, False), ("0.0.0.0", None, "from-env", False),
                                                    ("127.0.0.1", None, None, False)])
def test_beyond_loopback_without_a_key_warns_before_the_model_loads(serve, monkeypatch, capsys, host, key, env,
                                                                    warned):
    if env:
        monkeypatch.setenv("EBPO_API_KEY", env)
    rc, rec = serve(["--model", "preset:tiny", "--host", host, "--max-batch", "2", "--max-len", "64"], key=env)
    assert rc == 0
    assert rec["before_load"] == (WARNING.format(host) + "\n" if warned else "")
    assert rec["answers"]["models"][0] == 200 and rec["answers"]["keyless"] == (401 if env else 200)
    assert rec["service"].max_sequences == 8 and rec["threads"] == []  # 4 x --max-batch; --num-threads 0: torch's
    assert rec["answers"]["bodies"] == {4 * 2 ** 20: 400, 4 * 2 ** 20 + 1: 413}  # the 4 MiB default
    assert capsys.readouterr().err.endswith(", default quality, API key " + ("required" if env else "none") + ")\n")


def test_the_engine_thread_stops_when_the_server_fails(serve):
    with pytest.raises(RuntimeError, match="port in use"):
        serve(["--model", "preset:tiny", "--max-len", "64"], fail=True)
    assert serve.rec["closes"] == [2.0]


@pytest.mark.parametrize("argv, error", [
    (["--max-body-mb", "0"], "--max-body-mb must be > 0 and --shutdown-grace-s >= 0"),
    (["--max-body-mb", "-1"], "--max-body-mb must be > 0 and --shutdown-grace-s >= 0"),
    (["--shutdown-grace-s", "-0.5"], "--max-body-mb must be > 0 and --shutdown-grace-s >= 0"),
    (["--max-sequences", "0"], "--max-sequences must be >= 1, got 0"),
    (["--set", "max_new_tokens"], "override 'max_new_tokens': expected key=value"),
    (["--mode", "quality", "--set", "tau_mask=3"], "DecodeConfig.tau_mask: "),
])
def test_a_bad_setting_exits_2_before_loading_anything(serve, capsys, argv, error):
    rc, rec = serve(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("ebpo serve: " + error) and err.endswith("\n") and err.count("\n") == 1
    assert "service" not in rec and "config" not in rec


def test_the_smallest_accepted_settings_serve(serve):
    rc, rec = serve(["--model", "preset:tiny", "--max-sequences", "1", "--shutdown-grace-s", "0", "--max-len", "64"])
    assert rc == 0 and rec["service"].max_sequences == 1 and rec["grace_s"] == 0.0
