"""Where Ray places the engine replicas (`--ray-address`, `--ray-num-cpus`, `--ray-num-gpus`):
one frozen config, checked once, carried from the CLI or `stemma.Runtime` to the gateway."""
from __future__ import annotations

from dataclasses import dataclass

from stemma.field_doc import doc


@dataclass(frozen=True)
class RayPlacement:
    """Placing the replicas as Ray actors (serve.ray_replicas); unset `ray_address`: no Ray."""
    ray_address: str | None = doc(None, "place the replicas as Ray actors on the Ray cluster at "
                                        "this address (host:port of its head; 'auto': the one this "
                                        "machine belongs to), which restarts them when they die; "
                                        "needs stemma[ray]")
    ray_num_cpus: float = doc(1.0, "with a Ray cluster: the CPUs each replica's actor asks for "
                                   "(its engine runs that many threads)")
    ray_num_gpus: float = doc(0.0, "with a Ray cluster: the GPUs each replica's actor asks for "
                                   "(1 for an engine on CUDA)")

    def __post_init__(self):
        if self.ray_address is not None and not self.ray_address:
            raise ValueError("ray_address must not be empty (leave it unset for no Ray)")
        if self.ray_num_cpus < 0 or self.ray_num_gpus < 0:
            raise ValueError("ray_num_cpus and ray_num_gpus must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.ray_address is not None
