"""quantize/inspect"""
