"""Request workloads: real trace readers (torch-free, beside core) and generators."""
