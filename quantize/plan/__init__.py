"""quantize/plan"""
