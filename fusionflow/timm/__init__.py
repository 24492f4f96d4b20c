"""timm integration: `fusionflow.timm.create_loader`, timm's `create_loader` with FusionFlow's workers
underneath -- a timm training script changes its import and nothing else (fusionflow/timm/loader.py)."""

from fusionflow.timm.loader import TimmLoader, create_loader

__all__ = ["TimmLoader", "create_loader"]
