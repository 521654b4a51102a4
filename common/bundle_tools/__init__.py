# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tools that check, package and inspect the bundles under ``bundles/`` (each applies to every bundle folder)."""
