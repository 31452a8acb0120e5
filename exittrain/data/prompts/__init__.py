"""Prompt choice, in one place: which prompts a run trains and evaluates on, from which sources.

Its modules, from naming a source to a run's plan (each imports only those before it):
:mod:`~exittrain.data.prompts.source_spec` names a prompt source (the spec grammar, the prompt sets
installed packages ship); :mod:`~exittrain.data.prompts.domain_sources` lists each domain's default
sources; :mod:`~exittrain.data.prompts.source_reading` reads a source's rows and the prompt text of a
row (field paths, templates, CodeI/O stubs); :mod:`~exittrain.data.prompts.prompt_sets` turns them
into clean prompt sets, every rejected row counted, with no training prompt equal to an evaluation
prompt; :mod:`~exittrain.data.prompts.selection` samples training prompts by task under a seed and
splits off validation tasks; :mod:`~exittrain.data.prompts.prompt_plan` is a run's plan (the chosen
training and evaluation prompts, or answered conversations, and the cache entry of their answers),
which the DataModule and ``prepare`` both use. What is done with the chosen prompts (answering them,
the cache entry's rows and their split, batches) is the rest of :mod:`exittrain.data`. Nothing is
re-exported here: import each name from its module.
"""
