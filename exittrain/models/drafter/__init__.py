"""The block drafter, in one place. Its modules, each importing only those before it:
:mod:`~exittrain.models.drafter.configuration` (:class:`DrafterConfig`, what the drafter records of its
target, and :func:`check_pairing`); :mod:`~exittrain.models.drafter.layers` (the Qwen3-style layers
whose block queries attend to ``[context; block]``, and the cached context K/V);
:mod:`~exittrain.models.drafter.copy_branch` (the n-gram copy branch, an exittrain extension);
:mod:`~exittrain.models.drafter.starting_points` (default layer ids and heads, copies of target layers);
:mod:`~exittrain.models.drafter.saved_files` (checks on a saved drafter folder before Hugging Face reads
it); :mod:`~exittrain.models.drafter.block_drafter` (:class:`BlockDrafter`: what it computes, its entry
points, how it shares the target); :mod:`~exittrain.models.drafter.construction` (:func:`new_drafter`
for a target, :func:`load_drafter` for a saved or DFlash folder). The DFlash format itself is
:mod:`exittrain.models.dflash_format`. Nothing is re-exported here: import each name from its module
(or from :mod:`exittrain.models`, the models' public face). The drafter's log messages go to the
logger ``exittrain.models.drafter``, this package's.
"""
