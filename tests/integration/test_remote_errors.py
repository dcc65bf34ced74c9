"""How a failure inside a Ray actor reaches the user: with the cause's type and message, not "the actor died" (what
the train stage refuses before Ray starts is in tests/unit/test_train_inputs.py)."""

from __future__ import annotations

import sys

import pytest


class Unpicklable(Exception):
    def __init__(self, a, b):  # pickle would call Unpicklable("1/2"): Ray cannot carry it back as it is
        super().__init__(f"{a}/{b}")


class Toy:
    """An actor that fails to start when asked, and whose methods fail."""

    def __init__(self, fail: bool):
        if fail:
            raise ValueError("the prompt dataset is empty")
        self.seen: list[str] = []

    def ping(self) -> str:
        return "pong"

    def unpicklable(self) -> None:
        raise Unpicklable(1, 2)

    def with_callback(self) -> None:
        try:
            self.unpicklable()  # a call from inside the actor raises what the method raises
        except Unpicklable as err:
            raise KeyError(f"callback: {err}") from err


def test_an_actor_failure_reaches_the_driver_with_its_type_and_message(local_ray):
    import ray

    from slimeflow.cluster import LOCAL_RAY_SYSTEM_CONFIG
    from slimeflow.stages.train.remote import LoopError, call, hosted

    started = not ray.is_initialized()  # an in-process train test earlier in the session may have left its Ray up
    if started:
        ray.init(num_cpus=1, include_dashboard=False, configure_logging=False, log_to_driver=False,
                 _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    try:
        broken = ray.remote(num_cpus=0)(hosted(Toy)).remote(True)
        with pytest.raises(LoopError) as err:
            call(broken.ping.remote(), "starting the toy")
        assert str(err.value) == "starting the toy failed: Toy could not start: ValueError: the prompt dataset is empty"
        assert 'raise ValueError("the prompt dataset is empty")' in "".join(err.value.__notes__)  # its traceback
        toy = ray.remote(num_cpus=0)(hosted(Toy)).remote(False)
        assert call(toy.ping.remote(), "ping") == "pong"
        with pytest.raises(LoopError, match=r"^unpicklable failed: Unpicklable: 1/2\n"):
            call(toy.unpicklable.remote(), "unpicklable")
        with pytest.raises(LoopError, match=r"^callback failed: KeyError: 'callback: 1/2'\n"):
            call(toy.with_callback.remote(), "callback")
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        if started:
            ray.shutdown()
