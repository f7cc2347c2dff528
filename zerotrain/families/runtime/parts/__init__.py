"""The torch side of the shared parts (zerotrain.families.parts), and the parts that are torch only."""
