"""Workers: the single-device model runner and (for tensor_parallel_size > 1) the TP runner."""


def make_runner(config, files):
    """Build the runner for this config, with its KV cache allocated (num_kv_blocks set)."""
    info = files.info
    if config.tensor_parallel_size > 1:
        from pagedbackend.worker.tp_runner import TPRunner
        return TPRunner(config, files)
    from pagedbackend.worker.model_runner import ModelRunner
    runner = ModelRunner(config, files.hf_config, info.device, info.dtype)
    runner.init_kv_cache(info.max_num_batched_tokens, info.max_model_len)
    return runner
