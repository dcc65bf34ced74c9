"""The few SGLang server arguments the stand-in accepts (SGLang's ServerArgs has ~300): those slimeflow sets on
every server it launches (engine/sglang_launch.sglang_server_command), and some that tests pass as --sglang-* flags.
Any other flag is refused at parse, as SGLang refuses an unknown one."""

import dataclasses


@dataclasses.dataclass
class ServerArgs:
    model_path: str = ""
    host: str = "127.0.0.1"
    port: int = 30000
    nccl_port: int = 0
    tp_size: int = 1
    pp_size: int = 1
    base_gpu_id: int = 0
    gpu_id_step: int = 1
    random_seed: int = 0
    trust_remote_code: bool = False
    skip_server_warmup: bool = False
    api_key: str = ""
    mem_fraction_static: float = 0.9
    enable_memory_saver: bool = False
    context_length: int = 0
