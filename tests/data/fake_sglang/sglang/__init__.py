"""Test-only stand-in for SGLang (see ../README.md): only `sglang.launch_server`, `sglang.srt.server_args` and the
trainer-side names of `sglang.srt.weight_sync.tensor_bucket`."""
