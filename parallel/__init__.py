"""cp_train.parallel: every parallelism of the project and the process groups it runs on.

The public API is listed here and loaded lazily: ``from cp_train.parallel import context_parallel_attention``
loads the attention and its kernels, while a submodule such as ``cp_train.parallel.mesh`` loads only what it
imports. The library's own modules import from the defining modules, never from this face (docs/api.md).
"""

from __future__ import annotations

from cp_train.lazy_exports import lazy_exports

_EXPORTS = {  # public name -> the module that defines it
    "ring_flash_attn_func": "cp_train.parallel.cp.dropins",
    "zigzag_ring_flash_attn_func": "cp_train.parallel.cp.dropins",
    "stripe_flash_attn_func": "cp_train.parallel.cp.dropins",
    "ring_flash_attn_varlen_func": "cp_train.parallel.cp.dropins_varlen",
    "zigzag_ring_flash_attn_varlen_func": "cp_train.parallel.cp.dropins_varlen",
    "context_parallel_attention": "cp_train.parallel.cp.attention",
    "build_cp_plan": "cp_train.parallel.cp.attention",
    "CPPlan": "cp_train.parallel.cp.plan.batch_plan",
    "ALGORITHMS": "cp_train.parallel.cp.algorithms.registry",
    "CPAlgorithm": "cp_train.parallel.cp.algorithms.registry",
    "register_cp_algorithm": "cp_train.parallel.cp.algorithms.registry",
    "get_cp_algorithm": "cp_train.parallel.cp.algorithms.registry",
    "cp_algorithm_names": "cp_train.parallel.cp.algorithms.registry",
    "LAYOUTS": "cp_train.parallel.cp.layout",
    "shard_sequence": "cp_train.parallel.cp.layout",
    "unshard_sequence": "cp_train.parallel.cp.layout",
    "gather_sequence": "cp_train.parallel.cp.layout",
    "sequence_positions": "cp_train.parallel.cp.layout",
    "check_layout": "cp_train.parallel.cp.layout",
    "balanced_positions": "cp_train.parallel.cp.balanced_layout",
    "CPGroups": "cp_train.parallel.mesh.model_parallel",
    "ModelParallel": "cp_train.parallel.mesh.model_parallel",
    "ParallelDims": "cp_train.parallel.mesh.rank_groups",
    "compute_rank_groups": "cp_train.parallel.mesh.rank_groups",
    "ParallelState": "cp_train.parallel.mesh.groups",
    "initialize_parallel": "cp_train.parallel.mesh.state",
    "destroy_parallel": "cp_train.parallel.mesh.state",
    "parallel_context": "cp_train.parallel.mesh.state",
    "parallel_is_initialized": "cp_train.parallel.mesh.state",
    "get_parallel_state": "cp_train.parallel.mesh.state",
    "get_device_mesh": "cp_train.parallel.mesh.state",
    "get_tensor_model_parallel_group": "cp_train.parallel.mesh.state",
    "get_tensor_model_parallel_rank": "cp_train.parallel.mesh.state",
    "get_tensor_model_parallel_world_size": "cp_train.parallel.mesh.state",
    "get_context_parallel_group": "cp_train.parallel.mesh.state",
    "get_context_parallel_rank": "cp_train.parallel.mesh.state",
    "get_context_parallel_world_size": "cp_train.parallel.mesh.state",
    "get_context_parallel_global_ranks": "cp_train.parallel.mesh.state",
    "get_hierarchical_context_parallel_groups": "cp_train.parallel.mesh.state",
    "get_context_parallel_ring_neighbours": "cp_train.parallel.mesh.state",
    "get_data_parallel_group": "cp_train.parallel.mesh.state",
    "get_data_parallel_rank": "cp_train.parallel.mesh.state",
    "get_data_parallel_world_size": "cp_train.parallel.mesh.state",
    "get_tensor_and_context_parallel_group": "cp_train.parallel.mesh.state",
    "get_tensor_and_context_parallel_rank": "cp_train.parallel.mesh.state",
    "get_tensor_and_context_parallel_world_size": "cp_train.parallel.mesh.state",
    "SpawnedWorld": "cp_train.parallel.spawn",
    "free_port": "cp_train.parallel.spawn",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
