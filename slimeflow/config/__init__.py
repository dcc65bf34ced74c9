"""Configuration: one pydantic model per stage (field names are slime's flags in snake_case), composed into a
pipeline config, loaded from YAML and overridden by slime-spelled CLI flags.

Import from the submodules (`slimeflow.config.base`, `.flags`, `.infra`, `.pipeline`); this package's
`__init__` stays empty so that stage configs can import `base` without pulling in the pipeline.
"""
