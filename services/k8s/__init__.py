"""`deepinfer deploy k8s`: the stack of compose.yaml as Kubernetes manifests, rendered from a values file.

values.py holds every key with its default and meaning, sizing.py an engine's memory from the model preset,
manifests.py the objects, render.py the files.
"""
