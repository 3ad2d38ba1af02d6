"""quantize/base"""
