"""Test-only stand-in for SGLang (see ../README.md): only `sglang.launch_server` and `sglang.srt.server_args`."""
