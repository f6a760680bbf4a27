"""A flight recorder that records nothing: the baseline when measuring the real one's cost."""

from megatron.core.pipeline_parallel import flight_recorder


class NullRecorder(flight_recorder.FlightRecorder):
    def record(self, **kwargs):
        return None

    def complete(self, record) -> None:
        pass
