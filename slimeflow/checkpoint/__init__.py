"""The checkpoint format as a library: HF read (hf_source, convert.read_hf_source) and write (hf_write),
torch_dist read and write (torch_dist; its files: dcp_format), the HF <-> Megatron name map (mapping, over
slimeflow/families/), the distributed HF -> torch_dist conversion (convert, launch, worker), and the integrity
and publication helpers every stage that reads or writes checkpoints shares (their staging directories are
io/guard.py's). Stages import it; it imports no stage.
"""
