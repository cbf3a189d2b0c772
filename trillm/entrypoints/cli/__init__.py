"""The ``trillm`` command: its subcommands (``main``), ``trillm serve``'s flags (``serve_args``, ``flag_types``, ``vllm_flags``, ``config_file``) and headless nodes."""
