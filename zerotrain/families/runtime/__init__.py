"""The families' torch side: for each family (and part) zerotrain/families/<path>.py declares, the subclass of its
declarations at zerotrain/families/runtime/<path>.py that holds the members zerotrain.protocols marks torch_side
(zerotrain.families.parts.declared). Every module below imports torch, diffusers and transformers at its top;
nothing here is imported to plan."""
