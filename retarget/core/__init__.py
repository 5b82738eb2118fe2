"""Core: the vocabulary every layer shares (errors, module-tree helpers, the capture flag, the
world a plan is made for, the typed plan records). Imports nothing else from retarget but the
target language."""
