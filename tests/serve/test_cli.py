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
