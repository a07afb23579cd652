"""Plugins that run inside other programs (inference engines) to receive weightstream updates.

Nothing here is imported by ``import weightstream``; each module imports its host program only
when that program loads it."""
